"""Mixture-of-experts state beyond the weights' training: the engine's ``moe_stats`` (expert losses and load,
on every pipeline stage, experts or not; evaluation forwards not counted), the auxiliary-loss-free expert bias
(moved by DeepSeek-V3's rule, checkpointed and resumed), and expert checkpoints that hold the logical experts
and load at any ep. Training itself against one process is tests/test_moe_model.py's."""

import pytest
import torch
import torch.distributed as dist

from plait.layers import MoE, TransformerModel
from moe_helpers import moe_tiny


def stats_body():
    """pp=2 x dp=2, auxiliary-loss-free balancing on: one step, then ``engine.moe_stats()``; every layer's
    forwards recorded (name, weighted loss, tokens per expert) for the test to recompute both."""
    import plait
    from plait.layers.stages import build_stage_modules
    from plait.parallel import ParallelMesh
    from plait.parallel.pipeline.parallel import PipelineParallel
    from test_engine import GAS, ds_config, micro_batch

    mesh = ParallelMesh(pp=2)
    chunks = build_stage_modules(moe_tiny(moe_bias_update_rate=1e-3), mesh, seed=5)
    seen = []
    for name, m in chunks[0].named_modules():
        if isinstance(m, MoE):
            m.register_forward_hook(
                lambda mod, args, out, name=name: seen.append(
                    (name, out[1].loss.item(), out[1].tokens_per_expert.tolist())
                )
            )
    cfg = {**ds_config(1, 1), "pipeline": {"size": 2}}
    engine = plait.initialize(
        PipelineParallel(chunks, mesh, "1f1b", micro_batches=GAS), cfg, mesh=mesh
    )
    engine.train_batch(iter([micro_batch(0, g, mesh.dp_rank) for g in range(GAS)]))
    biases = {n: b.tolist() for n, b in chunks[0].named_buffers() if n.endswith("expert_bias")}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, (seen, biases))
    return engine.moe_stats(), engine.moe_stats(), records


def test_engine_reports_the_expert_losses_and_load_and_moves_the_expert_bias():
    """``moe_stats``: the mean over forwards of every layer's weighted losses, summed over the layers of both
    stages; the worst layer's max/mean tokens per expert over the step's tokens on both dp ranks; then None
    (nothing since). The expert bias after the step: ``u x sign(mean(c) - c)`` of each layer's counts c over
    both dp ranks (DeepSeek-V3's rule), the same on every rank."""
    from plait.testing import run_distributed

    results = run_distributed(stats_body, 4)
    first, second, records = results[0]
    per_layer = {}
    for seen, _ in records:
        for name, loss, counts in seen:
            entry = per_layer.setdefault(name, [[], torch.zeros(4, dtype=torch.float64)])
            entry[0].append(loss)
            entry[1] += torch.tensor(counts, dtype=torch.float64)
    assert len(per_layer) == 2 and all(
        len(v[0]) == 4 for v in per_layer.values()
    )  # 2 blocks x (2 dp x GAS 2)
    aux = sum(sum(losses) / len(losses) for losses, _ in per_layer.values())
    imbalance = max((c.max() / c.mean()).item() for _, c in per_layer.values())
    assert first["aux_loss"] == pytest.approx(aux, rel=1e-6)
    assert first["load_imbalance"] == pytest.approx(imbalance, rel=1e-6) and imbalance > 1.0
    assert first["dropped"] == 0.0 and second is None
    for name, (_, counts) in per_layer.items():
        want = (1e-3 * torch.sign(counts.mean() - counts)).tolist()
        held = [
            biases[name + ".expert_bias"]
            for _, biases in records
            if name + ".expert_bias" in biases
        ]
        assert len(held) == 2 and all(b == pytest.approx(want, abs=1e-9) for b in held), name
    assert all(r == results[0] for r in results[1:])  # every rank reports the same


def expert_checkpoint_body(ep, root):
    """Build the model at ``ep`` (seed 5) and save it; load the one-process checkpoint into a model built with
    another seed at ``ep`` and return its whole weights (gathered over ep)."""
    from plait.checkpoint.model_io import save_model_weights
    from plait.checkpoint.model_load import load_model_weights
    from plait.parallel import ParallelMesh
    from plait.parallel.sharding import gather_logical_state

    mesh = ParallelMesh(ep=ep)
    model = TransformerModel(moe_tiny(), mesh, seed=5)
    assert model.get_parameter("layers.1.mlp.gate_proj").shape[0] == 4 // ep
    save_model_weights(model, mesh, root, f"ep{ep}").wait()
    other = TransformerModel(moe_tiny(), mesh, seed=9)
    load_model_weights(other, root, tag="ep1")
    return gather_logical_state(other, ep_group=mesh.ep_group)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_checkpoints_hold_logical_experts_and_load_at_any_ep(ep, tmp_path):
    """Experts are saved as the logical ``[E, ...]`` tensors, each expert once: a checkpoint saved at ep=2 or 4
    loads into one process exactly, and one saved in one process loads at ep exactly (initialization is
    layout-invariant, so the one-process model of the same seed is the reference, bit for bit)."""
    from plait.checkpoint.model_io import save_model_weights
    from plait.checkpoint.model_load import load_model_weights
    from plait.parallel.sharding import gather_logical_state
    from plait.testing import run_distributed

    one = TransformerModel(moe_tiny(), None, seed=5)
    save_model_weights(one, None, str(tmp_path), "ep1").wait()
    want = gather_logical_state(one)
    for loaded in run_distributed(expert_checkpoint_body, ep, ep, str(tmp_path)):
        assert set(loaded) == set(want) and all(torch.equal(loaded[n], want[n]) for n in want)
    fresh = TransformerModel(moe_tiny(), None, seed=9)
    assert not torch.equal(
        fresh.get_parameter("layers.1.mlp.up_proj"), want["layers.1.mlp.up_proj"]
    )
    load_model_weights(fresh, str(tmp_path), tag=f"ep{ep}")
    got = gather_logical_state(fresh)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_the_expert_bias_is_checkpointed_and_resumed(tmp_path):
    """Auxiliary-loss-free balancing's bias is training state: a checkpoint holds it and a load restores it.
    (A checkpoint without it, a Hugging Face import, loads strictly and leaves it at zero, and an export leaves
    a bias of zeros out: ``test_convert_hf_moe``'s strict loads and ``dropped == []``.)"""
    from plait.checkpoint.model_io import save_model_weights
    from plait.checkpoint.model_load import load_model_weights
    from test_engine import micro_batch

    model = TransformerModel(moe_tiny(moe_bias_update_rate=0.01), None, seed=5)
    model(**micro_batch(0, 0, 0)).backward()
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.update_expert_bias()
    moved = [layer.expert_bias.clone() for layer in layers]
    assert all(b.abs().sum() > 0 for b in moved)
    save_model_weights(model, None, str(tmp_path), "moved").wait()
    fresh = TransformerModel(moe_tiny(moe_bias_update_rate=0.01), None, seed=5)
    load_model_weights(fresh, str(tmp_path), tag="moved")
    held = [m.expert_bias for m in fresh.modules() if isinstance(m, MoE)]
    assert all(torch.equal(a, b) for a, b in zip(held, moved))


def head_only_stage_body():
    """pp=4 over embedding, 2 blocks, head: the first and last stages hold no expert layer, yet every rank
    joins ``moe_stats``'s collectives (a stage without experts returning early would hang the others)."""
    import plait
    from plait.layers.stages import build_stage_modules
    from plait.parallel import ParallelMesh
    from plait.parallel.pipeline.parallel import PipelineParallel
    from test_engine import GAS, ds_config, micro_batch

    mesh = ParallelMesh(pp=4)
    chunks = build_stage_modules(moe_tiny(), mesh, seed=5)
    engine = plait.initialize(
        PipelineParallel(chunks, mesh, "1f1b", micro_batches=GAS),
        {**ds_config(1, 1), "pipeline": {"size": 4}},
        mesh=mesh,
    )
    engine.train_batch(iter([micro_batch(0, g, 0) for g in range(GAS)]))
    return sorted(chunks[0].layers), engine.moe_stats()


def test_stages_without_experts_join_the_statistics():
    from plait.testing import run_distributed

    results = run_distributed(head_only_stage_body, 4, timeout_s=120)
    assert [r[0] for r in results] == [["0"], ["1"], ["2"], ["3"]]
    stats = [r[1] for r in results]
    assert (
        all(s == stats[0] for s in stats)
        and stats[0]["load_imbalance"] >= 1.0
        and stats[0]["aux_loss"] > 0
    )


def test_evaluation_forwards_in_train_mode_are_not_counted():
    """Without gradients (``eval_batch`` in train mode), a forward moves neither the bias counts nor the
    statistics; a training forward does."""
    moe = MoE(16, 8, 4, 2, bias_update_rate=0.1)
    x = torch.randn(6, 16)
    with torch.no_grad():
        moe(x)
    assert moe.tokens_seen.sum() == 0 and moe.stats.sum() == 0
    moe(x)
    assert moe.tokens_seen.sum() == 12 and moe.stats[-1] == 1
