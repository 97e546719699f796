"""Fused projections (q/k/v as one column-parallel matmul, SwiGLU's gate and up as one) against the
unfused layers, float32 on CPU, at tp in {1, 2, 4}, sequence parallelism on for tp > 1.

Both models are built from the same seed, so their logical weights are bit-identical (initialization is
by logical name). The forward outputs are then equal up to float32 summation order: a fused output
column is the same dot product as the unfused one, but the input gradient of a fused layer is one GEMM
summing over q, k and v columns (gate and up) together where the unfused layers add three (two)
partial sums, and BLAS may block a wider GEMM differently. Each such difference is a few float32 ulps
(2^-24 ~ 6e-8) per element, accumulated over a handful of layers: the bound is 1e-6 relative (loss and
every logical gradient, floor 1e-3 for k_proj.bias, whose exact gradient is zero). Taking the fused
weight's rows in another order (k before q) breaks it by orders of magnitude (tested).
"""

import pytest
import torch
import torch.distributed as dist

from helpers import make_config, rel_err
from plait.checkpoint import CheckpointReader
from plait.checkpoint.model_io import save_model_weights
from plait.checkpoint.model_load import load_model_weights
from plait.layers import TransformerModel
from plait.layers.linear import ColumnParallelLinear
from plait.parallel import ParallelMesh
from plait.parallel.sharding import FusedShard, gather_logical_state, logical_parts, shard_of
from plait.testing import run_distributed
from test_tp_parity import make_batch

RTOL = 1e-6


def loss_and_grads(arch: str, mesh, sequence_parallel: bool, fused: bool, batch: dict):
    model = TransformerModel(
        make_config(arch, fused_projections=fused),
        mesh,
        sequence_parallel=sequence_parallel,
        seed=11,
    )
    loss = model(**batch)
    loss.backward()
    return model, loss.item(), gather_logical_state(model, mesh.tp_group, grads=True)


def parity_body(tp: int, sequence_parallel: bool):
    mesh = ParallelMesh(tp=tp)
    worst = {}
    for arch in ("gpt2", "llama"):
        batch = make_batch(arch)
        fused, f_loss, f_grads = loss_and_grads(arch, mesh, sequence_parallel, True, batch)
        plain, p_loss, p_grads = loss_and_grads(arch, mesh, sequence_parallel, False, batch)
        names = dict(fused.named_parameters())
        assert (
            "layers.1.attn.qkv_proj.weight" in names and "layers.1.attn.q_proj.weight" not in names
        )
        assert ("layers.1.mlp.gate_up_proj.weight" in names) == (arch == "llama")
        f_w, p_w = (
            gather_logical_state(fused, mesh.tp_group),
            gather_logical_state(plain, mesh.tp_group),
        )
        assert f_w.keys() == p_w.keys() == f_grads.keys() == p_grads.keys()
        assert all(torch.equal(f_w[k], p_w[k]) for k in f_w), (
            "logical weights differ at initialization"
        )
        errs = {k: rel_err(f_grads[k], p_grads[k], floor=1e-3) for k in p_grads}
        errs["loss"] = abs(f_loss - p_loss) / abs(p_loss)
        name = max(errs, key=errs.get)
        assert errs[name] <= RTOL, (
            f"{arch} tp={tp} sp={sequence_parallel}: {name} off by {errs[name]:.2e}"
        )
        worst[arch] = errs[name]
    return worst if dist.get_rank() == 0 else None


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_projections_match_the_unfused_layers(tp):
    for sp in [False] if tp == 1 else [True, False]:
        worst = run_distributed(parity_body, tp, tp, sp)[0]
        assert max(worst.values()) <= RTOL


def test_fused_rows_in_another_order_fail_the_bound():
    """The broken variant: the fused q/k/v weight with k's rows before q's (same weights, wrong
    order) is far outside the 1e-6 bound, so the parity test above can fail."""
    batch = make_batch("llama")
    _, p_loss, p_grads = loss_and_grads("llama", ParallelMesh(), False, False, batch)
    model = TransformerModel(make_config("llama", fused_projections=True), ParallelMesh(), seed=11)
    with torch.no_grad():
        for i in range(1, 4):
            w = model.layers[
                str(i)
            ].attn.qkv_proj.weight  # rows: q [0, 64), k [64, 96), v [96, 128)
            w[:96] = torch.cat([w[64:96], w[:64]])
    model(**batch).backward()
    grads = gather_logical_state(model, grads=True)
    err = max(rel_err(grads[k], p_grads[k], floor=1e-3) for k in p_grads)
    assert err > 1e3 * RTOL, err


def test_fused_parameter_names_its_logical_tensors():
    layer = ColumnParallelLinear(16, (8, 4, 4), True, parts=("q_proj", "k_proj", "v_proj"))
    spec = shard_of(layer.weight)
    assert (
        isinstance(spec, FusedShard)
        and spec.local_shape == (16, 16)
        and tuple(layer.weight.shape) == (16, 16)
    )
    parts = logical_parts("layers.3.attn.qkv_proj.weight", layer.weight)
    assert [(p.name, p.row, p.spec.logical_shape) for p in parts] == [
        ("layers.3.attn.q_proj.weight", 0, (8, 16)),
        ("layers.3.attn.k_proj.weight", 8, (4, 16)),
        ("layers.3.attn.v_proj.weight", 12, (4, 16)),
    ]
    assert [p.name for p in logical_parts("qkv_proj.bias", layer.bias)] == [
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
    ]
    q, k, v = layer.split(layer.local_forward(torch.randn(2, 3, 16)))
    assert q.shape == (2, 3, 8) and k.shape == v.shape == (2, 3, 4)


def test_fused_layer_refuses_mismatched_parts_and_names_the_part_that_does_not_divide():
    with pytest.raises(ValueError, match="one name in parts per entry"):
        ColumnParallelLinear(16, (8, 4), parts=("q_proj", "k_proj", "v_proj"))
    with pytest.raises(ValueError, match="one name in parts per entry"):
        ColumnParallelLinear(16, 8, parts=("q_proj",))
    with pytest.raises(ValueError, match="one name in parts per entry"):
        ColumnParallelLinear(16, (8, 8), parts=("gate_proj", "up_proj"), gather_output=True)
    run_distributed(_indivisible_body, 2)


def _indivisible_body():
    with pytest.raises(
        ValueError,
        match=r"out_features of k_proj \(3\) is not divisible by the tensor-parallel "
        r"size tp=2",
    ):
        ColumnParallelLinear(
            16, (8, 3, 3), parts=("q_proj", "k_proj", "v_proj"), group=ParallelMesh(tp=2).tp_group
        )


def interop_body(root: str, save_fused: bool):
    """Model weights saved at tp=2 by one variant load at tp=2 into the other, and at tp=1 (rank 0)."""
    mesh = ParallelMesh(tp=2)
    saved = TransformerModel(make_config("llama", fused_projections=save_fused), mesh, seed=3)
    save_model_weights(saved, mesh, root, "w").wait()
    other = TransformerModel(make_config("llama", fused_projections=not save_fused), mesh, seed=4)
    load_model_weights(other, root, tag="w")
    want = gather_logical_state(saved, mesh.tp_group)
    got = gather_logical_state(other, mesh.tp_group)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    if dist.get_rank() == 0:
        names = set(CheckpointReader(root, "w").names())
        assert "layers.1.attn.k_proj.weight" in names and "layers.1.mlp.gate_proj.weight" in names
        assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
        single = TransformerModel(make_config("llama", fused_projections=save_fused), None, seed=5)
        load_model_weights(single, root, tag="w")
        one = gather_logical_state(single)
        assert all(torch.equal(want[k], one[k]) for k in want)


@pytest.mark.parametrize("save_fused", [True, False])
def test_fused_and_unfused_models_share_checkpoints(tmp_path, save_fused):
    run_distributed(interop_body, 2, str(tmp_path / "ckpt"), save_fused)


def test_meta_fused_model_loads_from_a_checkpoint(tmp_path):
    """A fused parameter on the meta device is materialized once and filled part by part."""
    model = TransformerModel(make_config("llama", fused_projections=True), None, seed=3)
    save_model_weights(model, None, str(tmp_path), "w").wait()
    meta = TransformerModel(make_config("llama", fused_projections=True), None, device="meta")
    load_model_weights(meta, str(tmp_path), tag="w")
    want, got = gather_logical_state(model), gather_logical_state(meta)
    assert all(torch.equal(want[k], got[k]) for k in want)
