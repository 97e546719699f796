"""Float8 MoE experts (``plait.precision.float8_moe``) on a CPU.

torchao 0.18's float8 grouped GEMM (``torchao.prototype.moe_training``: ``Float8TrainingOpConfig``, rowwise
only) is CUDA-only: its casts are Triton kernels and ``torch._scaled_grouped_mm`` has no CPU kernel, and it has
no emulation mode (only the MXFP8 recipe has one). So on a CPU these tests check what plait adds around it:
* the padded layout (every token group a multiple of 16 rows, the last taking the buffer's tail), exactly;
* ``Float8MoE``'s data path (pad, three grouped GEMMs, unpad) with a high-precision grouped GEMM in torchao's
  place, against the unconverted ``MoE``, float32, in one process and expert-parallel over 2 gloo ranks: the
  same products of the same rows, only the zero rows and group sizes differ, which can change float32
  summation order: 1e-6 relative (l2; measured ~7e-8). Offsets left unpadded while the rows moved (some rows
  of one expert multiplied by another's weights) are off by O(1) and fail it; compiled in one graph (no host
  sync), it computes what eager does;
* which layers convert (exclude honoured, parameters kept) and the notice naming why experts stay in high
  precision.
torchao's float8 on an H200 against torchao's own converted experts: tests/gpu/run_float8_moe_gpu.py.
"""

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from helpers import rel_err, tiny

from plait.config.schema_fp8 import FP8Config
from plait.layers import MoE, TransformerModel
from plait.layers.init import init_parameters
from plait.precision.float8 import convert_to_float8
from plait.precision.float8_moe import Float8MoE, experts_refusal, padded_layout

H, FFN, E, T = 32, 16, 4, 24
SUM_ORDER = 1e-6  # float32 summation order (module docstring)


def hp_grouped_mm(x, weight, ends):
    """torch's high-precision grouped GEMM on the aligned groups, where torchao's float8 one runs on a GPU."""
    assert all(int(n) % 16 == 0 for n in torch.diff(ends, prepend=ends.new_zeros(1)))
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)


def hp_grouped_mm_bf16(x, weight, ends):
    """``hp_grouped_mm`` without the check (which reads the offsets on the host)."""
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)


def unpadded_offsets(counts):
    """Broken: a grouped GEMM given the unpadded group ends (the rows moved, the offsets did not): some of one
    expert's rows meet another expert's weights."""
    ends = torch.cumsum(counts, 0).to(torch.int32)
    return lambda x, weight, _: torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)


def layer(**kw):
    moe = MoE(H, FFN, E, 2, **kw)
    init_parameters(moe, seed=3)
    return moe


def run(moe, x, up):
    x = x.clone().requires_grad_()
    moe.zero_grad()
    y, aux = moe(x)
    (y * up).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}, aux


def test_the_padded_layout_aligns_every_group_and_keeps_each_experts_rows_in_order():
    dest, ends, size = padded_layout(torch.tensor([3, 0, 17, 16]), 36)
    assert size == 96  # 36 + 4 x 15 rows, rounded up to 16
    assert ends.dtype == torch.int32 and ends.tolist() == [
        16,
        16,
        48,
        96,
    ]  # the last takes the tail
    assert dest.tolist() == [0, 1, 2, *range(16, 33), *range(48, 64)]
    dest, ends, size = padded_layout(torch.tensor([0, 0]), 0)
    assert (dest.numel(), ends.tolist(), size) == (0, [0, 32], 32)  # no rows: zeros only


def test_float8_moes_data_path_equals_the_moe_and_an_unpadded_layout_fails():
    """Routing leaves groups of 15, 10, 10, 13 rows (none a multiple of 16)."""
    x = torch.randn(2, T // 2, H, generator=torch.Generator().manual_seed(1))
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    moe = layer()
    want = run(copy.deepcopy(moe), x, up)
    assert want[3].tokens_per_expert.tolist() == [15, 10, 10, 13]
    f8 = Float8MoE(moe, hp_grouped_mm)
    assert all(getattr(f8, n) is getattr(moe, n) for n in ("gate_proj", "router_weight"))
    y, dx, grads, _ = run(f8, x, up)
    assert rel_err(y, want[0]) <= SUM_ORDER and rel_err(dx, want[1]) <= SUM_ORDER
    assert grads.keys() == want[2].keys()
    for name, grad in want[2].items():
        assert rel_err(grads[name], grad) <= SUM_ORDER, name
    broken = run(Float8MoE(copy.deepcopy(moe), unpadded_offsets(want[3].tokens_per_expert)), x, up)
    assert rel_err(broken[0], want[0]) > 0.1


def expert_parallel_body():
    """Rank r's tokens (seed 10 + r) through 4 experts split over 2 ep ranks, run by ``Float8MoE`` with the
    high-precision grouped GEMM; returns the output, input gradient and this rank's expert gradients."""
    from plait.parallel import ParallelMesh

    mesh = ParallelMesh(ep=2)
    f8 = Float8MoE(layer(ep_group=mesh.ep_group), hp_grouped_mm)
    rank = dist.get_rank()
    x = torch.randn(2, T // 2, H, generator=torch.Generator().manual_seed(10 + rank))
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + rank))
    y, dx, grads, _ = run(f8, x, up)
    return y, dx, {n: grads[n] for n in ("gate_proj", "up_proj", "down_proj")}


def test_expert_parallel_float8_moe_equals_every_expert_in_one_process():
    """Outputs and input gradients per rank; each expert's gradient the sum over both ranks' tokens."""
    from plait.testing import run_distributed

    results = run_distributed(expert_parallel_body, 2)
    ref, total = layer(), {}
    for rank, (y, dx, _) in enumerate(results):
        x = torch.randn(2, T // 2, H, generator=torch.Generator().manual_seed(10 + rank))
        up = torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + rank))
        want_y, want_dx, want, _ = run(ref, x, up)
        assert rel_err(y, want_y) <= SUM_ORDER and rel_err(dx, want_dx) <= SUM_ORDER, rank
        for name in ("gate_proj", "up_proj", "down_proj"):
            total[name] = total.get(name, 0) + want[name]
    for rank, (*_, got) in enumerate(results):
        for name, grad in total.items():
            assert rel_err(got[name], grad[rank * 2 : rank * 2 + 2]) <= SUM_ORDER, (rank, name)


def moe_model(**kw):
    return TransformerModel(
        tiny(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48, num_layers=3, **kw), None, seed=3
    )


def test_an_h200_converts_the_experts_fp8_exclude_names_and_says_so_once(caplog):
    model = moe_model()
    before = dict(model.named_parameters())
    report = convert_to_float8(
        model,
        FP8Config(True, "rowwise", ["layers.1", "layers.3.mlp"]),
        torch.device("cuda"),
        capability=(9, 0),
        device_name="NVIDIA H200",
    )["experts"]
    assert report.converted == ["layers.2.mlp"] and report.kept == {}
    assert report.excluded == ["layers.1.mlp", "layers.3.mlp"]
    kinds = {n: type(model.layers[n].mlp).__name__ for n in ("1", "2", "3")}
    assert kinds == {"1": "MoE", "2": "Float8MoE", "3": "MoE"}
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert "layers.2.mlp.expert_bias" in model.state_dict()
    lines = [r.getMessage() for r in caplog.records if "MoE layer(s)" in r.getMessage()]
    assert lines == [
        (
            "fp8: 1 MoE layer(s) run their experts in float8 (torchao's rowwise float8 grouped GEMM, token "
            "groups padded to 16 rows); 2 excluded by fp8.exclude; 0 left in high precision"
        )
    ]
    assert "matches no linear layer" not in caplog.text  # "layers.3.mlp" named an MoE layer


def test_a_cpu_keeps_the_experts_in_high_precision_and_says_why_once(caplog):
    caplog.set_level(logging.WARNING, "plait")
    model = moe_model()
    report = convert_to_float8(model, FP8Config(True, "rowwise"), torch.device("cpu"))["experts"]
    assert report.converted == [] and not any(isinstance(m, Float8MoE) for m in model.modules())
    lines = [r.getMessage() for r in caplog.records if "MoE layer(s)" in r.getMessage()]
    assert lines == [
        (
            "fp8: 0 MoE layer(s) run their experts in float8 (torchao's rowwise float8 grouped GEMM, token "
            "groups padded to 16 rows); 0 excluded by fp8.exclude; 3 left in high precision: torchao's float8 "
            "grouped GEMM runs on CUDA GPUs only, not on 'cpu' (Triton casts and torch._scaled_grouped_mm; it "
            "has no emulation) (layers.1.mlp, layers.2.mlp, layers.3.mlp)"
        )
    ]


@pytest.mark.parametrize(
    "recipe, capability, kw, reason",
    [
        (
            "tensorwise",
            (9, 0),
            {},
            (
                "fp8.recipe 'tensorwise': torchao's float8 grouped GEMM scales rowwise only (set fp8.recipe "
                '"rowwise" to run them in float8)'
            ),
        ),
        (
            "rowwise",
            (8, 9),
            {},
            (
                "NVIDIA L40S (compute capability 8.9): torch._scaled_grouped_mm runs on compute capability "
                "9.0 and 10.0 only (H100/H200, B200)"
            ),
        ),
        (
            "rowwise",
            (9, 0),
            {"ffn": 40},
            "hidden size 32 or expert width 40 is not a multiple of 16",
        ),
        (
            "rowwise",
            (10, 0),
            {"dtype": torch.float16},
            "expert weights in torch.float16 (torchao's grouped GEMM takes bf16 or fp32)",
        ),
        (
            "rowwise",
            (9, 0),
            {"grouped_gemm": False},
            "grouped_gemm=False (torchao's float8 path is a grouped GEMM)",
        ),
        ("rowwise", (9, 0), {}, None),
    ],
)
def test_where_torchaos_grouped_float8_does_not_serve_the_reason_is_named(
    recipe, capability, kw, reason
):
    ffn = kw.pop("ffn", FFN)
    moe = MoE(H, ffn, E, 2, device="meta", **kw)
    assert experts_refusal(moe, recipe, "cuda", capability, "NVIDIA L40S") == reason


def test_the_padded_data_path_compiles_in_one_graph():
    """``torch.compile(fullgraph=True)`` (aot_eager: the same ATen kernels) traces the layout, the padding and
    the unpadding without a graph break or a host sync and computes what eager does, bit for bit (bf16: the
    dtype torch's grouped GEMM traces in)."""
    moe = MoE(H, FFN, E, 2, dtype=torch.bfloat16)
    init_parameters(moe, seed=3)
    f8 = Float8MoE(moe, hp_grouped_mm_bf16)
    x = torch.randn(2, T // 2, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    compiled = torch.compile(f8, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x)[0], f8(x)[0])
