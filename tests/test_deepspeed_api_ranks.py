"""``import plait.deepspeed as deepspeed`` on two gloo ranks: ``GatheredParameters``' edits, a DeepSpeed engine
loop against DDP and its resume, parameters whose ``.data`` is replaced, and a DeepSpeed script under torchrun
with only its import changed. Each test states its tolerance; the single-process API is
tests/test_deepspeed_api.py's."""

import math

import pytest
import torch

import plait.deepspeed as deepspeed
from plait.testing import run_distributed
from deepspeed_api_helpers import batch, bert, ds_config


def _edit_body(stage):
    import torch.distributed as dist

    cfg = ds_config(zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 100})
    engine, *_ = deepspeed.initialize(model=bert(), config=cfg)
    emb = engine.module.bert.embeddings.word_embeddings.weight
    with deepspeed.zero.GatheredParameters([emb], modifier_rank=0):
        if dist.get_rank() == 0:
            emb.data[5].fill_(0.25)  # only rank 0 edits; rank 1's value must follow
    with engine.gathered_parameters():
        after_exit = emb.detach()[5].clone()
    engine.optimizer.param_groups[0]["lr"] = 0.0  # a step at lr 0 with decay 0 must keep the edit
    engine.optimizer.param_groups[0]["weight_decay"] = 0.0
    engine.backward(engine(**batch(0, dist.get_rank())).loss)
    engine.step()
    with engine.gathered_parameters():
        after_step = emb.detach()[5].clone()
    with deepspeed.zero.GatheredParameters([emb]):  # no modifier_rank: an edit is not kept
        emb.data[6].fill_(9.0)
    with engine.gathered_parameters():
        unkept = emb.detach()[6].clone()
    return after_exit, after_step, unkept


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_modifier_rank_edits_persist(stage):
    for after_exit, after_step, unkept in run_distributed(_edit_body, 2, stage):
        assert torch.equal(after_exit, torch.full_like(after_exit, 0.25))
        assert torch.equal(after_step, torch.full_like(after_step, 0.25))
        if stage == 3:  # stage 2 keeps whole parameters: the edit stays until the next step
            assert not math.isclose(unkept[0].item(), 9.0)


def _engine_loop_body(stage, root):
    """A DeepSpeed engine loop on two ranks (each its own micro-batches): 3 steps, save with client_state,
    2 more; a second engine loads the checkpoint and repeats those 2. Beside it, DDP + torch AdamW."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()

    def loop(engine, steps):
        for step in steps:
            engine.backward(engine(**batch(step, rank)).loss)
            engine.step()

    model = bert()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(stage)
    )
    loop(engine, range(3))
    engine.save_checkpoint(root, client_state={"epoch": 7})
    loop(engine, range(3, 5))
    with engine.gathered_parameters():
        uninterrupted = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    fresh = bert()
    resumed, *_ = deepspeed.initialize(
        model=fresh, model_parameters=fresh.parameters(), config=ds_config(stage)
    )
    _, client_state = resumed.load_checkpoint(root)
    loop(resumed, range(3, 5))
    with resumed.gathered_parameters():
        after_resume = {n: p.detach().clone() for n, p in resumed.module.named_parameters()}
    ddp = DistributedDataParallel(bert())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(5):
        ddp(**batch(step, rank)).loss.backward()
        opt.step()
        opt.zero_grad()
    reference = {n: p.detach() for n, p in ddp.module.named_parameters()}
    return client_state, uninterrupted, after_resume, reference


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_engine_loop_on_two_ranks_matches_ddp_and_resumes(stage, tmp_path):
    """Tolerance 1e-5 (float32): the same AdamW on the same averaged gradient; DDP and ZeRO sum the two
    ranks' gradients in different bucket layouts (one rounding each), and Adam's normalised update carries
    that ~1e-7 relative difference at most to lr x 1e-3 = 1e-5 over five steps. Resuming is exact: the
    checkpoint holds the fp32 master weights and Adam's moments."""
    for client_state, uninterrupted, after_resume, reference in run_distributed(
        _engine_loop_body, 2, stage, str(tmp_path)
    ):
        assert client_state == {"epoch": 7}
        assert (
            max((after_resume[n] - uninterrupted[n]).abs().max().item() for n in reference) == 0.0
        )
        assert max((uninterrupted[n] - reference[n]).abs().max().item() for n in reference) <= 1e-5


def _replaced_data_body(replace):
    """ZeRO-2 at dp 2; after step 1 every parameter's ``.data`` is replaced by a copy (what accelerate's
    ``prepare_model`` -> ``model.to(device)`` did inside the Trainer's ``evaluate``), then 2 more steps."""
    import torch.distributed as dist

    engine, *_ = deepspeed.initialize(model=bert(), config=ds_config(2))
    for step in range(3):
        if step == 1 and replace:
            for p in engine.module.parameters():
                p.data = p.data.clone()
        engine.backward(engine(**batch(step, dist.get_rank())).loss)
        engine.step()
    with engine.gathered_parameters():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_parameters_given_copies_of_their_data_are_rebound_to_the_flat_buffers():
    """Before the fix the model kept reading the copies (frozen at step 1) and trained on stale weights."""
    kept, replaced = (run_distributed(_replaced_data_body, 2, flag)[0] for flag in (False, True))
    assert max((kept[n] - replaced[n]).abs().max().item() for n in kept) == 0.0


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_script_runs_under_torchrun_with_only_its_import_changed(stage, tmp_path):
    """tests/data/deepspeed_engine_script.py, written for DeepSpeed's engine (add_config_arguments,
    init_distributed, initialize with training_data, backward/step, save/load_checkpoint with client_state),
    on two processes: each rank trains on its part of the loader (dp 2), and a run resumed from the
    step-3 checkpoint repeats steps 4-5 exactly (the checkpoint holds the fp32 masters and Adam's moments)."""
    import json
    import os
    import subprocess
    import sys

    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(stage)))
    script = os.path.join(os.path.dirname(__file__), "data", "deepspeed_engine_script.py")
    for extra in ([], ["--resume"]):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                script,
                "--deepspeed",
                "--deepspeed_config",
                str(config),
                "--out",
                str(tmp_path),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr[-3000:]
    full = json.loads((tmp_path / "result.json").read_text())
    resumed = json.loads((tmp_path / "result-resumed.json").read_text())
    assert full["dp"] == 2 and full["global_steps"] == resumed["global_steps"] == 5
    assert resumed["client_state"] == {"epoch": 1, "seen": 3}
    assert resumed["losses"] == full["losses"][3:] and resumed["checksum"] == full["checksum"]
    assert len(set(full["losses"])) == 5  # the steps saw different batches
