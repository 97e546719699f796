"""Megatron-LM's scatter/gather of pipeline transfers under tensor parallelism (Narayanan et al., SC'21,
Sec. 4.1; ``PipelineParallel(slice_tp=...)``, ``plait.parallel.pipeline.p2p.TPSlices``) on CPU/gloo, pp=2 x tp=2
(4 processes, one launch for the whole file).

Without sequence parallelism every tp rank of a stage sends the same ``[b, s, h]`` activation (and input
gradient); with slicing each sends its contiguous ``1/tp`` part of the flattened tensor and the receiving
stage all-gathers the parts over tp before the action that reads them. Checked here:

- the premise, for plait's layers: a stage's output and its input gradient are bitwise equal on the tp ranks
  (GPT-2 with dropout in training mode, Llama, a Llama mixture of experts; embedding, middle and head stages);
- ``TPSlices`` alone: parts of ``ceil(n / tp)`` elements, zero padding when tp does not divide n, views
  (no copy) when it does, and the all-gather rebuilds the tensor bitwise (plait's models need tp to divide the
  hidden size, so their transfers never need the padding: it is checked here only);
- the pipeline, schedules 1f1b, zb-h1 and interleaved (v=2), GPT-2 (tied embeddings) and Llama: with slicing the
  loss and every
  gradient are bitwise EQUAL to the same pipeline with whole sends (``slice_tp=False``): the arithmetic is the
  same, only the transport changes, and an all-gather copies bytes; every send carried ``ceil(b*s*h / 2)``
  elements (``executor.sent_elements``), the whole sends ``b*s*h``;
- both against the single-process float32 model (plain gradient accumulation over the same micro-batches): the
  loss to 1e-6 relative and every gradient to 2e-6 in the metric ||g - g_ref|| / max(||g_ref||, 1e-3) (tp=2
  splits the row-parallel matmuls' and the vocabulary's sums differently from one process: float32 rounding
  of reordered sums, a few ulps (2^-23 ~ 1.2e-7 each) of the gradient's scale; a wrong or missing part moves
  them by O(1));
- sequence parallelism on (Llama, ``[b, s/2, h]`` shards differ per tp rank): slicing resolves off, sends stay
  whole (``b * s/2 * h`` elements), the result matches the reference, and ``slice_tp=True`` is refused.
"""

import math

import pytest
import torch
import torch.distributed as dist
from helpers import rel_err, tiny

from plait.layers import TransformerModel
from plait.layers.init import TIED_ATTR
from plait.layers.stages import build_stage_modules
from plait.parallel import ParallelMesh
from plait.parallel.pipeline.p2p import TPSlices
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.parallel.sharding import gather_logical
from plait.testing import run_distributed

LOSS_RTOL, GRAD_RTOL = 1e-6, 2e-6
M = 4  # micro-batches per step
SEQS = (8, 12, 6, 10)  # sequence length of micro-batch i (shapes vary in a step)
# label -> (schedule, v, arch, sequence parallelism)
CASES = {
    "1f1b gpt2": ("1f1b", 1, "gpt2", False),
    "1f1b llama": ("1f1b", 1, "llama", False),
    "zb-h1 gpt2": ("zb-h1", 1, "gpt2", False),
    "zb-h1 llama": ("zb-h1", 1, "llama", False),
    "interleaved gpt2": ("interleaved", 2, "gpt2", False),
    "1f1b llama sp": ("1f1b", 1, "llama", True),
}


def make_config(arch: str, **overrides):
    """``tiny(arch)`` (hidden 32, vocabulary 257) with 4 blocks, no dropout unless overridden."""
    return tiny(
        arch, **{"num_layers": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides}
    )


def make_microbatches(vocab: int = 257) -> list[dict]:
    """M micro-batches of 2 samples, ``input_ids``/``labels`` ``[2, SEQS[i]]``, a few labels -100."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(M):
        ids = torch.randint(0, vocab, (2, SEQS[i]), generator=g)
        labels = torch.randint(0, vocab, ids.shape, generator=g)
        labels[0, : 1 + i % 3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def equal_over_tp(t: torch.Tensor, mesh) -> bool:
    """Whether ``t`` is bitwise the same on every tp rank (collective over tp)."""
    parts = [torch.empty_like(t) for _ in range(mesh.tp)]
    dist.all_gather(parts, t.contiguous(), group=mesh.tp_group)
    return all(torch.equal(p, parts[0]) for p in parts)


# ---- bodies (run on every rank) ------------------------------------------------------------


def replicas(mesh) -> dict:
    """{(arch, first layer): (output equal over tp, input gradient equal over tp)} for stages of plait models."""
    configs = {
        "gpt2 dropout": make_config("gpt2", hidden_dropout=0.1, attention_dropout=0.1),
        "llama": make_config("llama"),
        "llama moe": make_config("llama", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32),
    }
    out, g = {}, torch.Generator().manual_seed(3)
    for name, cfg in configs.items():
        batch = make_microbatches()[1]
        shape = (*batch["input_ids"].shape, cfg.hidden_size)
        for layers in (
            range(0, 2),
            range(2, 4),
            range(4, 6),
        ):  # embedding + block, blocks, block + head
            stage = TransformerModel(cfg, mesh, layers=layers, seed=11).train()
            x = None if layers.start == 0 else torch.randn(shape, generator=g).requires_grad_()
            y = stage(hidden=x, **batch)
            grad = None if y.dim() == 0 else torch.randn(y.shape, generator=g)
            torch.autograd.backward(y, grad)
            out[(name, layers.start)] = (
                y.dim() == 0 or equal_over_tp(y.detach(), mesh),
                x is None or equal_over_tp(x.grad, mesh),
            )
    return out


def slices_unit(mesh) -> dict:
    """TPSlices on its own: padded and unpadded round trips, and views where no padding is needed."""
    slices, g = TPSlices(mesh.tp_group), torch.Generator().manual_seed(mesh.pp_rank)
    out = {}
    for shape in ((3, 5, 7), (2, 6, 4)):
        t = torch.randn(shape, generator=g)  # the same on both tp ranks of a stage
        part = slices.part(t)
        whole = slices.gather(part, shape)
        is_view = part.data_ptr() == t.data_ptr() + mesh.tp_rank * part.numel() * t.element_size()
        out[shape] = (part.numel(), torch.equal(whole, t), is_view or t.numel() % mesh.tp != 0)
    return out


def reference(cfg, batches: list[dict]):
    """(loss, {logical name: grad}) of the single-process float32 model: gradient accumulation, loss / m."""
    whole = TransformerModel(cfg, None, seed=11)
    total = 0.0
    for b in batches:
        loss = whole(**b) / len(batches)
        loss.backward()
        total += loss.item()
    grads = {}
    for n, p in whole.named_parameters():
        grads.update(gather_logical(n, p, None, p.grad))
    return total, grads


def expected_sends(pipe, batches, tp: int) -> dict:
    """{Transfer key: elements} this rank should post: sliced ``ceil(n/tp)`` or whole ``n``."""
    ex, p, last = pipe.executor, pipe.p, pipe.p * pipe.v - 1
    want = {}
    for chunk in range(pipe.v):
        s = chunk * p + pipe.rank
        for mb, batch in enumerate(batches):
            n = math.prod(ex.activation_shape(batch))
            n = -(-n // tp) if pipe.slice_tp else n
            if s < last:
                want[("F", mb, s)] = n
            if s > 0:
                want[("B", mb, s)] = n
    return want


def run_case(mesh, schedule, v, arch, sp, slice_tp):
    cfg = make_config(arch)
    batches = make_microbatches()
    chunks = build_stage_modules(cfg, mesh, v, sequence_parallel=sp, seed=11)
    pipe = PipelineParallel(
        chunks, mesh, schedule, micro_batches=M, virtual_stages=v, slice_tp=slice_tp
    )
    loss = pipe.train_batch(iter(batches))
    sent = {
        (t.direction, t.microbatch, t.src_stage): n for t, n in pipe.executor.sent_elements.items()
    }
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    return pipe, loss, grads, sent, sent == expected_sends(pipe, batches, mesh.tp)


def ref_errors(mesh, pipe, loss, arch) -> tuple[float, float]:
    want_loss, want = reference(make_config(arch), make_microbatches())
    worst = 0.0
    for name, p in pipe.named_parameters():
        for logical, full in gather_logical(
            getattr(p, TIED_ATTR, None) or name, p, mesh.tp_group, p.grad
        ).items():
            worst = max(worst, rel_err(full, want[logical], floor=1e-3))
    return abs(loss.item() - want_loss) / abs(want_loss), worst


def pipeline_case(mesh, schedule, v, arch, sp) -> dict:
    sliced, loss, grads, sent, sent_ok = run_case(mesh, schedule, v, arch, sp, None)
    row = dict(
        slice_tp=sliced.slice_tp,
        sent_ok=sent_ok,
        sends=len(sent),
        sizes=sorted(set(sent.values())),
        ref=ref_errors(mesh, sliced, loss, arch),
    )
    if not sp:  # the same pipeline with whole sends: the same bits
        whole, whole_loss, whole_grads, _, whole_ok = run_case(mesh, schedule, v, arch, sp, False)
        row.update(
            whole_slice_tp=whole.slice_tp,
            whole_sent_ok=whole_ok,
            loss_equal=torch.equal(loss, whole_loss),
            differing=[n for n in grads if not torch.equal(grads[n], whole_grads[n])],
        )
    else:
        try:
            run_case(mesh, schedule, v, arch, sp, True)
            row["refused"] = False
        except ValueError as exc:
            row["refused"] = "sequence parallelism" in str(exc)
    return row


def body() -> dict:
    mesh = ParallelMesh(pp=2, tp=2)
    return {
        "replicas": replicas(mesh),
        "unit": slices_unit(mesh),
        "cases": {label: pipeline_case(mesh, *case) for label, case in CASES.items()},
    }


# ---- tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_distributed(body, 4, timeout_s=400)


def test_stage_tensors_are_identical_on_tp_ranks(per_rank):
    for rank, res in enumerate(per_rank):
        for key, (out_equal, grad_equal) in res["replicas"].items():
            assert out_equal and grad_equal, (rank, key, out_equal, grad_equal)


def test_tp_slices_pad_and_rebuild_bitwise(per_rank):
    for res in per_rank:
        assert res["unit"] == {(3, 5, 7): (53, True, True), (2, 6, 4): (24, True, True)}, res[
            "unit"
        ]


@pytest.mark.parametrize("label", [k for k, case in CASES.items() if not case[3]])
def test_sliced_sends_give_the_same_bits_as_whole_sends(per_rank, label):
    """Slicing on (resolved automatically), every send 1/tp, loss and gradients bitwise those of whole sends."""
    for rank, res in enumerate(per_rank):
        row = res["cases"][label]
        assert row["slice_tp"] and not row["whole_slice_tp"], (label, rank)
        # each send carried exactly ceil(b*s*h / 2) elements, each whole send b*s*h (expected_sends)
        assert row["sent_ok"] and row["whole_sent_ok"] and row["sends"] > 0, (label, rank, row)
        assert row["loss_equal"] and not row["differing"], (label, rank, row["differing"])


@pytest.mark.parametrize("label", list(CASES))
def test_matches_single_process_reference(per_rank, label):
    for rank, res in enumerate(per_rank):
        loss_err, grad_err = res["cases"][label]["ref"]
        assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL, (label, rank, loss_err, grad_err)


def test_sequence_parallel_keeps_whole_sends(per_rank):
    """SP shards differ per tp rank: slicing resolves off, each send is the whole [b, s/2, h], True is refused."""
    batches = make_microbatches()
    for res in per_rank:
        row = res["cases"]["1f1b llama sp"]
        assert not row["slice_tp"] and row["sent_ok"] and row["refused"], row
        assert row["sizes"] == sorted({b["input_ids"].numel() // 2 * 32 for b in batches}), row[
            "sizes"
        ]
