"""Pipeline-parallel parity on CPU/gloo: pp in {2, 4} x tp in {1, 2} x dp in {1, 2} (world size up to 8)
x schedule in {gpipe, 1f1b, interleaved (v=2), zb-h1, zb-v (v=2, V placement)} x {GPT-2 (tied embeddings),
Llama (GQA, untied)}.

Each configuration runs one ``PipelineParallel.train_batch`` on dp x m micro-batches (dp rank d takes
micro-batches d*m .. d*m+m-1; micro-batches differ in sequence length, so activation shapes change
within a step), all-reduces gradients over dp itself (the pipeline does not), gathers every gradient
to its whole logical tensor over tp, and compares with the float64 single-process reference
(reference_models.py) on the same global batch: loss = mean over the dp*m micro-batches of each
micro-batch's mean token loss (labels != -100).

Tolerances (float32 vs float64): the loss to 1e-5 relative; every gradient to 1e-5 in the
norm-relative metric ||g - g_ref|| / max(||g_ref||, 1e-3), as in test_tp_parity.py (the floor only
matters for k_proj.bias, whose exact gradient is zero). The tied head copy's gradient must equal the
embedding's summed gradient, and the two copies must be bitwise equal after the step.

Runtime is kept low by one process launch per world size that loops over its configurations.
"""

import pytest
import torch
import torch.distributed as dist
from reference_models import reference_loss
from helpers import rel_err

from plait.layers import TransformerModel
from plait.models import preset
from plait.layers.init import TIED_ATTR
from plait.layers.stages import build_stage_modules, layer_parameter_counts
from plait.parallel import ParallelMesh
from plait.parallel.pipeline.partition import partition_layers
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.parallel.pipeline.registry import get_schedule, placement
from plait.parallel.pipeline.schedules import stage_of
from plait.parallel.sharding import gather_logical, gather_logical_state
from plait.parallel.pipeline.simulate import simulate
from plait.testing import run_distributed

RTOL = 1e-5
MICRO = 2  # samples per micro-batch
SEQS = (8, 12, 6, 10)  # sequence length of micro-batch i is SEQS[i % 4] (even: tp=2 with SP)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
ARCHES = ("gpt2", "llama")
METHODS = ("uniform", "parameters", "explicit")


def make_config(arch: str):
    kw = {
        "vocab_size": 1001,
        "num_layers": 6,
        "hidden_size": 32,
        "num_heads": 4,
        "max_position_embeddings": 64,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    if arch == "llama":
        kw.update(num_kv_heads=2, ffn_hidden_size=64)
    return preset(f"{arch}-tiny", **kw)


def make_microbatches(count: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        s = SEQS[i % len(SEQS)]
        ids = torch.randint(0, 1001, (MICRO, s), generator=g)
        labels = torch.randint(0, 1001, (MICRO, s), generator=g)
        labels[i % MICRO, : 1 + i % 3] = -100
        out.append({"input_ids": ids, "labels": labels})
    ids = out[0]["input_ids"]
    ids[0, 0] = 1000  # the last real vocabulary row (padding follows it on the last tp rank)
    return out


def reference(arch: str, batches: list[dict]):
    """(loss, {name: grad}) of the float64 single-process model: mean of the micro-batch losses."""
    cfg = make_config(arch)
    weights = {
        n: t.double().requires_grad_()  # logical names and shapes: vocab padding dropped
        for n, t in gather_logical_state(TransformerModel(cfg, None, seed=11)).items()
    }
    loss = sum(reference_loss(cfg, weights, b["input_ids"], b["labels"]) for b in batches) / len(
        batches
    )
    loss.backward()
    return loss.item(), {n: w.grad for n, w in weights.items()}


def layouts(world: int) -> list[tuple[int, int, int]]:
    """(pp, tp, dp) with pp in {2, 4}, tp and dp in {1, 2} and pp*tp*dp == world."""
    return [
        (pp, tp, dp) for pp in (2, 4) for tp in (1, 2) for dp in (1, 2) if pp * tp * dp == world
    ]


def check_one(mesh, arch, schedule, method, cache, m=4) -> tuple[float, float]:
    """Run one configuration; raise AssertionError on a mismatch; return (loss err, worst grad err)."""
    cfg = make_config(arch)
    pp, tp, dp = mesh.pp, mesh.tp, mesh.dp
    v = 2 if schedule in ("interleaved", "zb-v") else 1
    n = cfg.num_layers + 2
    if method == "explicit":  # deliberately uneven: as much as possible on the first stage
        parts = list(range(pp * v)) + [n]
        parts[1:-1] = [n - pp * v + i for i in range(1, pp * v)]
        split = parts
    else:
        split = method
    sp = tp > 1 and arch == "llama"
    chunks = build_stage_modules(
        cfg, mesh, v, split, sequence_parallel=sp, seed=11, schedule=schedule
    )
    stages = partition_layers(
        n, pp, v, split, layer_parameter_counts(cfg) if split == "parameters" else None
    )
    for c, chunk in enumerate(chunks):  # each chunk builds exactly its own layers
        s = stage_of(mesh.pp_rank, c, pp, placement(schedule))
        assert chunk.layer_indices == list(range(*stages[s])), (c, chunk.layer_indices)
    pipe = PipelineParallel(chunks, mesh, schedule=schedule, micro_batches=m, virtual_stages=v)
    key = (arch, dp * m)
    if key not in cache:
        batches = make_microbatches(dp * m, seed=5)
        cache[key] = (batches, *reference(arch, batches))
    batches, ref_loss, ref_grads = cache[key]
    mine = batches[mesh.dp_rank * m : (mesh.dp_rank + 1) * m]
    loss = pipe.train_batch(iter(mine))
    sim = simulate(
        get_schedule(schedule, pp, m, v), pp, v, shape=placement(schedule)
    )  # activations freed as listed
    assert pipe.executor.peak_in_flight == sim.peak_in_flight[mesh.pp_rank], (
        pipe.executor.peak_in_flight
    )
    eval_loss = pipe.eval_batch(iter(mine))
    assert torch.allclose(eval_loss, loss, rtol=1e-6, atol=0), (eval_loss, loss)
    params = dict(pipe.named_parameters())
    for p in params.values():
        dist.all_reduce(p.grad, group=mesh.dp_group)
        p.grad /= dp
    dist.all_reduce(loss, group=mesh.dp_group)
    loss /= dp
    loss_err = abs(loss.item() - ref_loss) / abs(ref_loss)
    assert loss_err <= RTOL, f"loss {loss.item()} vs reference {ref_loss} (rel {loss_err:.2e})"
    worst = (0.0, "")
    for pname, p in params.items():
        tied = getattr(p, TIED_ATTR, None)
        for name, full in gather_logical(tied or pname, p, mesh.tp_group, p.grad).items():
            err = rel_err(full, ref_grads[name], floor=1e-3)
            worst = max(worst, (err, name))
            assert err <= RTOL, f"gradient of {name} off by {err:.2e} relative"
    if (
        cfg.tie_embeddings and pipe.tied_group is None and pipe.tied_parameters
    ):  # zb-v: both copies here
        first, head = pipe.tied_parameters
        assert torch.equal(first.grad, head.grad), "tied copies of the embedding gradient differ"
    elif cfg.tie_embeddings:  # both copies still equal (compare over the (first, last) stage pair)
        for name, p in params.items():
            if name == "layers.0.word_embeddings.weight" or getattr(p, TIED_ATTR, None):
                other = p.grad.clone()
                dist.all_reduce(other, group=pipe.tied_group, op=dist.ReduceOp.MAX)
                assert torch.equal(other, p.grad), (
                    f"tied copies of the embedding gradient differ ({name})"
                )
    return loss_err, worst[0]


def parity_body(world: int):
    cache, results, k = {}, [], 0
    for pp, tp, dp in layouts(world):
        mesh = ParallelMesh(tp=tp, pp=pp, dp=dp)
        for schedule in SCHEDULES:
            for arch in ARCHES:
                method = METHODS[k % len(METHODS)]
                k += 1
                label = f"pp={pp} tp={tp} dp={dp} {schedule} {arch} {method}"
                try:
                    errs = check_one(mesh, arch, schedule, method, cache)
                except AssertionError as exc:
                    raise AssertionError(f"[{label}] {exc}") from exc
                results.append((label, *errs))
        if pp == 4 and tp * dp == 1:  # m < p: the schedules' documented fallback (mostly bubble)
            for schedule in ("1f1b", "zb-h1"):
                results.append(
                    (
                        f"pp=4 m=2 {schedule}",
                        *check_one(mesh, "gpt2", schedule, "uniform", cache, m=2),
                    )
                )
    return results


@pytest.mark.parametrize("world", [2, 4, 8])
def test_pipeline_parity(world):
    results = run_distributed(parity_body, world, world, timeout_s=300)
    rows = results[0]
    assert len(rows) == 2 * len(SCHEDULES) * len(layouts(world)) + 2 * (world == 4)
    for label, loss_err, grad_err in rows:
        assert loss_err <= RTOL and grad_err <= RTOL, label


# ---- single process: the executor with p = 1 and the zero-bubble split ----------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_single_process_pipeline_matches_accumulation(schedule):
    """p = 1 (interleaved: v = 2 chunks on one rank, handing activations over locally; tied copies
    summed locally): grads equal plain gradient accumulation of the whole model, loss averaged."""
    v = 2 if schedule in ("interleaved", "zb-v") else 1
    for arch in ARCHES:
        cfg = make_config(arch)
        batches = make_microbatches(3, seed=9)
        whole = TransformerModel(cfg, None, seed=11)
        want_loss = sum(whole(**b) for b in batches) / 3
        want_loss.backward()
        want = {n: p.grad for n, p in whole.named_parameters()}
        ready = []
        pipe = PipelineParallel(
            build_stage_modules(cfg, None, v, seed=11),
            None,
            schedule,
            micro_batches=3,
            grads_ready=ready.append,
        )
        loss = pipe.train_batch(iter(batches))
        assert sorted(ready) == list(range(v))  # each chunk reported once, after its last backward
        assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
        for name, p in pipe.named_parameters():
            ref = want[getattr(p, TIED_ATTR, None) or name]
            assert rel_err(p.grad, ref, floor=1e-3) <= RTOL, (
                schedule,
                arch,
                name,
                rel_err(p.grad, ref, floor=1e-3),
            )
        with pytest.raises(ValueError, match="ran out after 2 of 3 micro-batches"):
            pipe.eval_batch(iter(batches[:2]))


@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1"])
def test_train_batch_callbacks_and_chunk_contract(schedule):
    """``scale_loss`` maps each micro-batch's loss to what backward differentiates (x2 -> gradients x2),
    ``on_micro_batch`` fires once per micro-batch, the loss is float32 of shape [] on the pipeline's
    device, the tied copies are public, and a chunk without the StageChunk members is refused by name."""
    v = 2 if schedule in ("interleaved", "zb-v") else 1
    cfg, batches = make_config("gpt2"), make_microbatches(3, seed=9)
    plain = PipelineParallel(
        build_stage_modules(cfg, None, v, seed=11), None, schedule, micro_batches=3
    )
    plain.train_batch(iter(batches))
    calls = []
    pipe = PipelineParallel(
        build_stage_modules(cfg, None, v, seed=11), None, schedule, micro_batches=3
    )
    loss = pipe.train_batch(
        iter(batches), scale_loss=lambda x: x * (2.0 / 3), on_micro_batch=lambda: calls.append(1)
    )
    assert (
        len(calls) == 3
        and loss.dtype == torch.float32
        and loss.shape == ()
        and loss.device == pipe.device
    )
    assert len(pipe.tied_parameters) == (2 if v == 2 else 0) and pipe.tied_group is None
    for (name, a), b in zip(plain.named_parameters(), pipe.parameters()):
        assert torch.allclose(2 * a.grad, b.grad, rtol=1e-6, atol=0), name
    with pytest.raises(
        TypeError, match=r"lacks \['tied_across_stages', 'activation_shape', 'tied_parameters'\]"
    ):
        PipelineParallel([TransformerModel(cfg, None, seed=11)], None, "1f1b", micro_batches=1)


def test_zero_bubble_split_defers_weight_gradients():
    """BI leaves every .grad untouched and returns the exact input gradient; BW then produces the
    same parameter gradients as one plain backward, without re-running the input half."""
    from plait.parallel.pipeline.backward import backward_input, backward_weight

    for arch in ARCHES:
        cfg = make_config(arch)
        stage = TransformerModel(cfg, None, layers=range(2, 8), seed=11)  # blocks 2..6 and the head
        batch = make_microbatches(1, seed=3)[0]
        x0 = torch.randn(*batch["input_ids"].shape, cfg.hidden_size)
        x = x0.clone().requires_grad_()
        stage(hidden=x, **batch).backward()
        want = {n: p.grad.clone() for n, p in stage.named_parameters()}
        want_x = x.grad
        stage.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        gx, pending = backward_input(stage(hidden=x, **batch), None, x)
        assert pending.split and all(p.grad is None for p in stage.parameters())
        assert rel_err(gx, want_x, floor=1e-3) <= 1e-6 and x.grad is None
        backward_weight(pending)
        for n, p in stage.named_parameters():
            assert rel_err(p.grad, want[n], floor=1e-3) <= 1e-6, n


def test_zero_bubble_split_falls_back_on_shared_weight_nodes():
    """A transposed weight computed once and used twice (a parameter-side node with two parents)
    makes the cut unsafe: BW re-runs the whole backward instead, still exactly."""
    from plait.parallel.pipeline.backward import backward_input, backward_weight

    w = torch.randn(4, 4, requires_grad=True)
    x0 = torch.randn(3, 4)

    def stage(x):
        wt = w.t()
        return torch.tanh(x @ wt) @ wt

    x = x0.clone().requires_grad_()
    stage(x).backward(torch.ones(3, 4))
    want_w, want_x = w.grad.clone(), x.grad.clone()
    w.grad = None
    x = x0.clone().requires_grad_()
    gx, pending = backward_input(stage(x), torch.ones(3, 4), x)
    assert not pending.split and w.grad is None
    backward_weight(pending)
    assert torch.allclose(gx, want_x) and torch.allclose(w.grad, want_w)


# ---- close(): a process that builds many pipelines keeps no groups of the old ones ----------------


def close_body():
    from torch.distributed import distributed_c10d

    mesh = ParallelMesh(tp=1, pp=2, dp=1)
    batches = make_microbatches(4, seed=5)
    groups_before = len(distributed_c10d._world.pg_map)
    losses, counts = [], []
    for _ in range(2):  # gpt2 ties its embedding across the two stages: channels and the tied group
        chunks = build_stage_modules(
            make_config("gpt2"), mesh, 1, "uniform", seed=11, schedule="1f1b"
        )
        pipe = PipelineParallel(chunks, mesh, schedule="1f1b", micro_batches=4)
        assert pipe.tied_group is not None and None not in pipe.executor.p2p.groups
        counts.append(len(distributed_c10d._world.pg_map) - groups_before)
        losses.append(pipe.train_batch(iter(batches)).item())
        pipe.close()
        pipe.close()  # twice: nothing more to destroy
        assert len(distributed_c10d._world.pg_map) == groups_before
        with pytest.raises(RuntimeError, match="closed"):
            pipe.train_batch(iter(batches))
    return counts, losses


def test_close_destroys_the_pipelines_groups():
    """Each pipeline adds its 3 groups (2 p2p channels + the tied pair) and close() removes them, so the
    second pipeline of the process runs on fresh groups and computes the first one's loss exactly."""
    for counts, losses in run_distributed(close_body, 2):
        assert counts == [3, 3], counts
        assert losses[0] == losses[1], losses
