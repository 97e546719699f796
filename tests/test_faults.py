"""A bad step never destroys a run (CPU/gloo, dp 2).

One nan in one parameter's gradient on one rank: the global gradient norm (float64, all-reduced over
dp x tp x pp) is nan on every rank, so every rank skips the step, in fp32, bf16 and fp16 and at ZeRO
stages 1-3. The weights then equal, bit for bit, those of a run that never saw that step's batches: a
skipped step changes no master, no optimizer state, no step count and no lr. ``max_consecutive_skips``
skips in a row end the run with ``NonFiniteError`` naming the step and the last finite loss, and a save
of non-finite weights is refused before anything is written, so ``latest`` and ``keep_last`` keep the last
good checkpoint. A frozen rank is caught within ``comm.timeout_s``. (Bad input: test_input_faults.py; a
checkpoint that cannot be trusted: test_checkpoint_refusals.py.)"""

import math
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

import plait
from plait.checkpoint.errors import CheckpointError
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from plait.zero.precision import NonFiniteError
from helpers import micro_batch, tiny
from faults_helpers import BAD_STEP, GAS, STEPS, ds_config


def train(cfg, poison=(), drop=(), save_dir=None):
    """Steps ``0..STEPS-1``; on rank 1 a nan is written into one element of one parameter's gradient at the
    steps in ``poison``; the steps in ``drop`` are not trained at all (the reference for a skip). With
    ``save_dir``, a checkpoint (keep_last 1) after every step; a refused save is recorded, not raised.
    fp16: a dropped step lowers the loss scale as a skipped one does (the scale changes the fp16 rounding
    of every later gradient), so the reference differs from a skip in nothing but the nan."""
    mesh = ParallelMesh()
    model = TransformerModel(tiny(), mesh, seed=5)
    engine = plait.initialize(model, cfg, mesh=mesh)
    armed = {"on": False}

    def inject(grad):
        if not armed["on"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = math.nan
        return grad

    victim = dict(model.named_parameters())["layers.2.mlp.down_proj.weight"]
    victim.register_hook(inject)
    refused = []
    for step in range(STEPS):
        if step in drop:
            if (
                engine.optimizer.scaler is not None
            ):  # fp16: a skip also halves the loss scale, by design
                engine.optimizer.scaler.update(True)
            continue
        armed["on"] = step in poison and mesh.dp_rank == 1
        for j in range(GAS):
            loss = engine(**micro_batch(step, j, mesh.dp_rank))
            engine.backward(loss)
            engine.step()
        if save_dir is not None:
            try:
                engine.save_checkpoint(save_dir, keep_last=1)
            except CheckpointError as err:
                refused.append((step, str(err)))
    with engine.optimizer.gathered_parameters():
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    masters = {(s.name, s.start): s.master.clone() for s in engine.optimizer.shard_state().slices}
    return {
        "weights": weights,
        "masters": masters,
        "steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "lr": engine.get_lr()[0],
        "refused": refused,
    }


CASES = [(p, s) for p in ("fp32", "bf16", "fp16") for s in (1, 2, 3)]


def _skip_body():
    out = {}
    for precision, stage in CASES:
        out[(precision, stage)] = (
            train(ds_config(stage, precision), poison={BAD_STEP}),
            train(ds_config(stage, precision), drop={BAD_STEP}),
        )
    return out


@pytest.fixture(scope="module")
def skip_results():
    return run_distributed(_skip_body, 2, timeout_s=300)


@pytest.mark.parametrize("precision,stage", CASES)
def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(skip_results, precision, stage):
    for rank, out in enumerate(skip_results):
        got, ref = out[(precision, stage)]
        # DeepSpeed's counts: a skipped step is a step taken (global_steps) and a skipped one
        assert (got["skipped"], got["steps"]) == (1, STEPS) and (ref["skipped"], ref["steps"]) == (
            0,
            STEPS - 1,
        )
        assert got["lr"] == ref["lr"]  # the schedule did not advance on the skip
        for part in ("weights", "masters"):
            for key, want in ref[part].items():
                assert torch.isfinite(got[part][key]).all(), (rank, part, key)
                assert torch.equal(got[part][key], want), (rank, part, key)


def _limit_body():
    try:
        train(ds_config(2, max_skips=2), poison={1, 2})
    except NonFiniteError as err:
        return str(err)
    return None


def test_consecutive_skips_end_the_run_naming_the_step_and_the_last_loss():
    messages = run_distributed(_limit_body, 2, timeout_s=300)
    for msg in messages:  # every rank stops, with the same facts
        assert msg is not None and "2 optimizer steps in a row (up to step 3)" in msg
        assert (
            "the last applied step was 1 (loss " in msg and "max_consecutive_skips (now 2)" in msg
        )


def _save_body(root):
    guarded = train(ds_config(2), poison={BAD_STEP}, save_dir=os.path.join(root, "guarded"))
    unguarded = train(
        ds_config(2, guard=False), poison={BAD_STEP}, save_dir=os.path.join(root, "unguarded")
    )
    dist.barrier()
    return (
        guarded["refused"],
        unguarded["refused"],
        {
            run: (
                open(os.path.join(root, run, "latest")).read().strip(),
                sorted(os.listdir(os.path.join(root, run))),
            )
            for run in ("guarded", "unguarded")
        },
    )


def test_a_save_never_replaces_or_prunes_the_last_good_checkpoint():
    with tempfile.TemporaryDirectory() as root:
        guarded_refused, unguarded_refused, dirs = run_distributed(
            _save_body, 2, root, timeout_s=300
        )[0]
    # guarded: the skipped step leaves finite weights, so every save goes through
    assert (
        guarded_refused == [] and dirs["guarded"][0] == "global_step4"
    )  # 4 steps taken, 1 of them skipped
    # unguarded: the nan step is applied; every later save is refused and global_step1 (after step 0) stays
    assert [step for step, _ in unguarded_refused] == [1, 2, 3]
    assert (
        "holds inf/nan" in unguarded_refused[0][1]
        and "latest still names the last good" in unguarded_refused[0][1]
    )
    assert dirs["unguarded"][0] == "global_step1" and "global_step1" in dirs["unguarded"][1]


def _pipeline_body(precision):
    """tp=2 x pp=2 (4 ranks, 1F1B, ZeRO-1): a nan in one gradient element on the last rank (pp stage 1,
    tp rank 1) at ``BAD_STEP`` against the run that drops that step."""
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel

    def run(poison=(), drop=()):
        mesh = ParallelMesh(tp=2, pp=2)
        chunks = build_stage_modules(tiny(), mesh, seed=5)
        cfg = ds_config(1, precision)
        cfg["tensor_parallel"], cfg["pipeline"] = {"size": 2}, {"size": 2, "schedule": "1f1b"}
        engine = plait.initialize(
            PipelineParallel(chunks, mesh, schedule="1f1b", micro_batches=GAS), cfg, mesh=mesh
        )
        armed = {"on": False}
        victim = next(
            p for n, p in chunks[0].named_parameters() if n.endswith("mlp.down_proj.weight")
        )
        victim.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), math.nan) if armed["on"] else g
        )
        for step in range(STEPS):
            if step in drop:
                if engine.optimizer.scaler is not None:
                    engine.optimizer.scaler.update(True)
                continue
            armed["on"] = step in poison and dist.get_rank() == dist.get_world_size() - 1
            engine.train_batch(iter([micro_batch(step, j, mesh.dp_rank) for j in range(GAS)]))
        with engine.optimizer.gathered_parameters():
            weights = {
                n: p.detach().float().clone() for c in chunks for n, p in c.named_parameters()
            }
        return weights, engine.skipped_steps, engine.global_steps

    return run(poison={BAD_STEP}), run(drop={BAD_STEP})


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_nan_gradient_under_tp_and_pp_skips_the_step_on_every_rank(precision):
    for rank, (got, ref) in enumerate(run_distributed(_pipeline_body, 4, precision, timeout_s=300)):
        assert got[1:] == (1, STEPS) and ref[1:] == (0, STEPS - 1), rank
        for name, want in ref[0].items():
            assert torch.equal(got[0][name], want), (rank, name)


def _frozen_rank_body(root):
    import signal
    import time

    cfg = ds_config(2)
    cfg["comm"] = {"timeout_s": 3, "startup_timeout_s": 60}
    mesh = ParallelMesh()
    engine = plait.initialize(TransformerModel(tiny(), mesh, seed=5), cfg, mesh=mesh)
    engine.train_batch(
        iter([micro_batch(0, j, mesh.dp_rank) for j in range(GAS)])
    )  # start-up ends here
    engine.save_checkpoint(
        root
    )  # saves run under the start-up timeout, then the short one comes back
    if mesh.dp_rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, as by a debugger or a swapped-out host
    start = time.monotonic()
    try:
        engine.train_batch(iter([micro_batch(1, j, mesh.dp_rank) for j in range(GAS)]))
    except (
        RuntimeError
    ) as err:  # reported through the harness's error channel, with the time it took
        raise RuntimeError(
            f"rank 0 caught the frozen peer after {time.monotonic() - start:.1f}s: {err}"
        ) from None
    return "not caught"


def test_a_frozen_rank_is_caught_within_the_configured_timeout(tmp_path):
    import time
    from plait.testing import DistributedTestError

    start = time.monotonic()
    with pytest.raises(
        DistributedTestError
    ) as err:  # rank 1 never answers; rank 0 reports the timeout
        run_distributed(_frozen_rank_body, 2, str(tmp_path), timeout_s=120)
    msg = str(err.value)
    assert "ranks [1] did not finish" in msg and "rank 0 caught the frozen peer after" in msg
    waited = float(re.search(r"caught the frozen peer after (\d+\.\d)s", msg).group(1))
    assert 2.5 <= waited <= 15 and time.monotonic() - start < 60, (
        waited
    )  # comm.timeout_s = 3, not 60 or 600


def test_a_skipped_step_is_logged_with_its_number_and_norm(caplog):
    mesh = ParallelMesh()
    model = TransformerModel(tiny(), mesh, seed=5)
    engine = plait.initialize(model, ds_config(2), mesh=mesh)
    dict(model.named_parameters())["layers.1.attn.q_proj.weight"].register_hook(
        lambda g: g * math.nan
    )
    with caplog.at_level("WARNING", logger="plait"):
        for j in range(GAS):
            engine.backward(engine(**micro_batch(0, j, 0)))
            engine.step()
    assert (
        engine.skipped_steps == 1 and engine.global_steps == 1
    )  # taken and skipped, as DeepSpeed counts
    assert (
        "optimizer step 1 skipped on every rank: global gradient norm is nan (1 in a row)"
        in caplog.text
    )
