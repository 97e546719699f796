"""A bad step never destroys a run (CPU/gloo, dp 2).

One nan in one parameter's gradient on one rank: the global gradient norm (float64, all-reduced over
dp x tp x pp) is nan on every rank, so every rank skips the step, in fp32, bf16 and fp16 and at ZeRO
stages 1-3. The weights then equal, bit for bit, those of a run that never saw that step's batches: a
skipped step changes no master, no optimizer state, no step count and no lr. ``max_consecutive_skips``
skips in a row end the run with ``NonFiniteError`` naming the step and the last finite loss, and a save
of non-finite weights is refused before anything is written, so ``latest`` and ``keep_last`` keep the last
good checkpoint."""
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
from plait.models import preset
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from plait.zero.precision import NonFiniteError
from helpers import micro_batch, tiny

STEPS, MICRO, GAS, SEQ, BAD_STEP = 4, 2, 2, 16, 1


def ds_config(stage, precision="fp32", guard=True, max_skips=10):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                        "warmup_num_steps": 3, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 3000,
                                 "stage3_param_persistence_threshold": 100},
           "nonfinite_guard": {"enabled": guard, "max_consecutive_skips": max_skips}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


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
            if engine.optimizer.scaler is not None:    # fp16: a skip also halves the loss scale, by design
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
    return {"weights": weights, "masters": masters, "steps": engine.global_steps, "skipped": engine.skipped_steps,
            "lr": engine.get_lr()[0], "refused": refused}


CASES = [(p, s) for p in ("fp32", "bf16", "fp16") for s in (1, 2, 3)]


def _skip_body():
    out = {}
    for precision, stage in CASES:
        out[(precision, stage)] = (train(ds_config(stage, precision), poison={BAD_STEP}),
                                   train(ds_config(stage, precision), drop={BAD_STEP}))
    return out


@pytest.fixture(scope="module")
def skip_results():
    return run_distributed(_skip_body, 2, timeout_s=300)


@pytest.mark.parametrize("precision,stage", CASES)
def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(skip_results, precision, stage):
    for rank, out in enumerate(skip_results):
        got, ref = out[(precision, stage)]
        # DeepSpeed's counts: a skipped step is a step taken (global_steps) and a skipped one
        assert (got["skipped"], got["steps"]) == (1, STEPS) and (ref["skipped"], ref["steps"]) == (0, STEPS - 1)
        assert got["lr"] == ref["lr"]                      # the schedule did not advance on the skip
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
    for msg in messages:                                   # every rank stops, with the same facts
        assert msg is not None and "2 optimizer steps in a row (up to step 3)" in msg
        assert "the last applied step was 1 (loss " in msg and "max_consecutive_skips (now 2)" in msg


def _save_body(root):
    guarded = train(ds_config(2), poison={BAD_STEP}, save_dir=os.path.join(root, "guarded"))
    unguarded = train(ds_config(2, guard=False), poison={BAD_STEP}, save_dir=os.path.join(root, "unguarded"))
    dist.barrier()
    return guarded["refused"], unguarded["refused"], {
        run: (open(os.path.join(root, run, "latest")).read().strip(), sorted(os.listdir(os.path.join(root, run))))
        for run in ("guarded", "unguarded")}


def test_a_save_never_replaces_or_prunes_the_last_good_checkpoint():
    with tempfile.TemporaryDirectory() as root:
        guarded_refused, unguarded_refused, dirs = run_distributed(_save_body, 2, root, timeout_s=300)[0]
    # guarded: the skipped step leaves finite weights, so every save goes through
    assert guarded_refused == [] and dirs["guarded"][0] == "global_step4"   # 4 steps taken, 1 of them skipped
    # unguarded: the nan step is applied; every later save is refused and global_step1 (after step 0) stays
    assert [step for step, _ in unguarded_refused] == [1, 2, 3]
    assert "holds inf/nan" in unguarded_refused[0][1] and "latest still names the last good" in unguarded_refused[0][1]
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
        engine = plait.initialize(PipelineParallel(chunks, mesh, schedule="1f1b", micro_batches=GAS), cfg, mesh=mesh)
        armed = {"on": False}
        victim = next(p for n, p in chunks[0].named_parameters() if n.endswith("mlp.down_proj.weight"))
        victim.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.nan) if armed["on"] else g)
        for step in range(STEPS):
            if step in drop:
                if engine.optimizer.scaler is not None:
                    engine.optimizer.scaler.update(True)
                continue
            armed["on"] = step in poison and dist.get_rank() == dist.get_world_size() - 1
            engine.train_batch(iter([micro_batch(step, j, mesh.dp_rank) for j in range(GAS)]))
        with engine.optimizer.gathered_parameters():
            weights = {n: p.detach().float().clone() for c in chunks for n, p in c.named_parameters()}
        return weights, engine.skipped_steps, engine.global_steps

    return run(poison={BAD_STEP}), run(drop={BAD_STEP})


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_nan_gradient_under_tp_and_pp_skips_the_step_on_every_rank(precision):
    for rank, (got, ref) in enumerate(run_distributed(_pipeline_body, 4, precision, timeout_s=300)):
        assert got[1:] == (1, STEPS) and ref[1:] == (0, STEPS - 1), rank
        for name, want in ref[0].items():
            assert torch.equal(got[0][name], want), (rank, name)


@pytest.mark.parametrize("section,key,value,allowed", [
    ("optimizer", "lr", -1e-3, "a finite number >= 0"), ("optimizer", "lr", math.nan, "a finite number >= 0"),
    ("optimizer", "betas", [1.5, 0.9], "two numbers in [0, 1)"), ("optimizer", "eps", -1.0, "a finite number >= 0"),
    ("optimizer", "weight_decay", -0.1, "a finite number >= 0"), (None, "gradient_clipping", math.nan, "finite")])
def test_config_values_are_range_checked_naming_the_key(section, key, value, allowed):
    from plait.config import ConfigError, load_config
    cfg = {"train_micro_batch_size_per_gpu": 1}
    if section:
        cfg["optimizer"] = {"type": "AdamW", "params": {key: value}}
    else:
        cfg[key] = value
    with pytest.raises(ConfigError) as err:
        load_config(cfg, world_size=1)
    assert f"{'optimizer.params.' if section else ''}{key} = " in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("damage", ["latest", "meta"])
def test_damaged_json_and_latest_raise_a_checkpoint_error_naming_the_file(tmp_path, damage):
    from plait.checkpoint.errors import read_json, read_text
    engine = plait.initialize(TransformerModel(tiny(), ParallelMesh(), seed=5), ds_config(2), mesh=ParallelMesh())
    engine.save_checkpoint(tmp_path)
    path = tmp_path / "latest" if damage == "latest" else tmp_path / "global_step0" / "meta.json"
    path.write_bytes(b"\xff\xfe not text")
    read = read_text if damage == "latest" else read_json
    with pytest.raises(CheckpointError, match=f"{path} is damaged: not UTF-8"):
        read(str(path))
    with pytest.raises(CheckpointError, match="damaged|checksum|does not match"):
        engine.load_checkpoint(tmp_path)


@pytest.mark.parametrize("change", [{"num_heads": 8, "num_kv_heads": 4}, {"rope_theta": 5e5}, {"norm_eps": 1e-1}])
def test_a_checkpoint_refuses_a_model_that_computes_differently(tmp_path, change):
    mesh = ParallelMesh()
    saved = plait.initialize(TransformerModel(tiny(), mesh, seed=5), ds_config(2), mesh=mesh)
    saved.save_checkpoint(tmp_path)
    other = plait.initialize(TransformerModel(tiny().replace(**change), mesh, seed=5), ds_config(2), mesh=mesh)
    key, value = next(iter(change.items()))
    with pytest.raises(CheckpointError, match=f"{key}: checkpoint {getattr(tiny(), key)!r}, model {value!r}"):
        other.load_checkpoint(tmp_path)
    other.load_checkpoint(tmp_path, allow_config_change=True)   # on purpose: loads, same weights
    with saved.optimizer.gathered_parameters(), other.optimizer.gathered_parameters():
        for (n, a), (_, b) in zip(saved.module.named_parameters(), other.module.named_parameters()):
            assert torch.equal(a, b), n


BAD_INPUTS = [("input_ids", 5000, "input_ids[1, 3] = 5000"), ("input_ids", -7, "input_ids[1, 3] = -7"),
              ("input_ids", 257, "input_ids[1, 3] = 257"), ("labels", 260, "labels[1, 3] = 260"),
              ("labels", -5, "labels[1, 3] = -5")]


def _tp_pp_engine(tp, pp):
    """ZeRO-1 engine over tp x pp (1F1B) x dp, and its mesh."""
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel
    mesh = ParallelMesh(tp=tp, pp=pp)
    cfg = ds_config(1)
    cfg["tensor_parallel"] = {"size": tp}
    if pp > 1:
        cfg["pipeline"] = {"size": pp, "schedule": "1f1b"}
        model = PipelineParallel(build_stage_modules(tiny(), mesh, seed=5), mesh, schedule="1f1b", micro_batches=GAS)
    else:
        model = TransformerModel(tiny(), mesh, seed=5)
    return plait.initialize(model, cfg, mesh=mesh), mesh


def _good_step(engine, mesh):
    """One good step; returns this rank's whole weights."""
    engine.train_batch(iter([micro_batch(0, j, mesh.dp_rank) for j in range(GAS)]))
    with engine.optimizer.gathered_parameters():
        return {n: p.detach().clone() for c in (engine.pipeline.stage_modules if engine.pipeline else [engine.module])
                for n, p in c.named_parameters()}


def _bad_input_body(tp, pp):
    """Every rank of tp x pp x dp meets the same bad micro-batch (pulled whole, checked before any rank computes)."""
    engine, mesh = _tp_pp_engine(tp, pp)
    messages = []
    for key, value, _ in BAD_INPUTS:
        batches = [{k: v.clone() for k, v in micro_batch(0, j, mesh.dp_rank).items()} for j in range(GAS)]
        batches[1][key][1, 3] = value
        try:
            engine.train_batch(iter(batches))
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
        zero = engine.optimizer   # the failed step's accumulation was dropped
        leftovers = zero.micro_steps + sum(p.grad is not None for p in zero.params) + \
            sum(g.untyped_storage().nbytes() for g in zero.grad_shards)   # given back: 0 bytes
        assert leftovers == 0, (key, value, leftovers)
    after = _good_step(engine, mesh)   # the bad steps left nothing: equals a fresh engine's first step
    return messages, engine.global_steps, after


def _good_step_body(tp, pp):
    return _good_step(*_tp_pp_engine(tp, pp))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_out_of_range_ids_and_labels_raise_naming_value_position_and_vocab(tp, pp):
    runs = run_distributed(_bad_input_body, 2, tp, pp, timeout_s=300)
    fresh = run_distributed(_good_step_body, 2, tp, pp, timeout_s=300)
    for (messages, steps, after), want in zip(runs, fresh):
        assert steps == 1                                  # only the good step was applied
        assert after.keys() == want.keys() and all(torch.equal(after[n], want[n]) for n in want)
        for (_, _, where), msg in zip(BAD_INPUTS, messages):
            assert msg is not None and where in msg and "vocab_size (257)" in msg, msg
            assert ("[0, 257) or -100 (ignored)" if where.startswith("labels") else "[0, 257). ") in msg


def test_malformed_batches_and_short_iterators_name_what_was_expected():
    engine = plait.initialize(TransformerModel(tiny(), ParallelMesh(), seed=5), ds_config(1), mesh=ParallelMesh())
    good = micro_batch(0, 0, 0)
    with pytest.raises(TypeError, match="input_ids must be an integer tensor of token ids .* got torch.float32"):
        engine(input_ids=good["input_ids"].float(), labels=good["labels"])
    with pytest.raises(ValueError, match=r"input_ids is empty \(shape \[0, 16\]\)"):
        engine(input_ids=good["input_ids"][:0], labels=good["labels"][:0])
    with pytest.raises(ValueError, match="scalar mean loss, got \\[2, 16, 384\\].*put the labels in the batch"):
        engine.backward(engine(input_ids=good["input_ids"]))
    with pytest.raises(ValueError, match="ran out after 1 of the 2 micro-batches of step 1"):
        engine.train_batch(iter([good]))
    assert engine.global_steps == 0


def test_the_index_carries_its_own_checksum(tmp_path):
    engine = plait.initialize(TransformerModel(tiny(), ParallelMesh(), seed=5), ds_config(2), mesh=ParallelMesh())
    engine.save_checkpoint(tmp_path)
    index = tmp_path / "global_step0" / "index.json"
    text = index.read_text()
    assert '"index_checksum": "sha256:' in text
    index.write_text(text.replace('"writers": 1', '"writers": 2'))     # a valid edit the old checks pass
    with pytest.raises(CheckpointError, match="its own checksum .* does not match its contents"):
        engine.load_checkpoint(tmp_path)


def _frozen_rank_body(root):
    import signal
    import time
    cfg = ds_config(2)
    cfg["comm"] = {"timeout_s": 3, "startup_timeout_s": 60}
    mesh = ParallelMesh()
    engine = plait.initialize(TransformerModel(tiny(), mesh, seed=5), cfg, mesh=mesh)
    engine.train_batch(iter([micro_batch(0, j, mesh.dp_rank) for j in range(GAS)]))   # start-up ends here
    engine.save_checkpoint(root)   # saves run under the start-up timeout, then the short one comes back
    if mesh.dp_rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)       # frozen, as by a debugger or a swapped-out host
    start = time.monotonic()
    try:
        engine.train_batch(iter([micro_batch(1, j, mesh.dp_rank) for j in range(GAS)]))
    except RuntimeError as err:   # reported through the harness's error channel, with the time it took
        raise RuntimeError(f"rank 0 caught the frozen peer after {time.monotonic() - start:.1f}s: {err}") from None
    return "not caught"


def test_a_frozen_rank_is_caught_within_the_configured_timeout(tmp_path):
    import time
    from plait.testing import DistributedTestError
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as err:   # rank 1 never answers; rank 0 reports the timeout
        run_distributed(_frozen_rank_body, 2, str(tmp_path), timeout_s=120)
    msg = str(err.value)
    assert "ranks [1] did not finish" in msg and "rank 0 caught the frozen peer after" in msg
    waited = float(re.search(r"caught the frozen peer after (\d+\.\d)s", msg).group(1))
    assert 2.5 <= waited <= 15 and time.monotonic() - start < 60, waited   # comm.timeout_s = 3, not 60 or 600


def test_a_learning_rate_is_never_guessed():
    from plait.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="'optimizer.params.lr' is \"auto\" but nothing resolves it; pass lr="):
        load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                    world_size=1)
    assert load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                       world_size=1, lr=2e-5).optimizer.params["lr"] == 2e-5
    engine = plait.initialize(TransformerModel(tiny(), ParallelMesh(), seed=5), {"train_micro_batch_size_per_gpu": 1},
                              mesh=ParallelMesh())   # no optimizer: forward only (tests/test_forward_only.py)
    with pytest.raises(ConfigError, match="built without an optimizer"):
        engine.step()


def test_a_gpt2_checkpoint_refuses_another_activation(tmp_path):
    gpt2 = preset("gpt2-tiny", vocab_size=257, hidden_size=32, num_layers=2, num_heads=4)
    mesh = ParallelMesh()
    cfg = {**ds_config(2), "gradient_clipping": 0.0}
    plait.initialize(TransformerModel(gpt2, mesh, seed=5), cfg, mesh=mesh).save_checkpoint(tmp_path)
    other = plait.initialize(TransformerModel(gpt2.replace(activation="gelu"), mesh, seed=5), cfg, mesh=mesh)
    with pytest.raises(CheckpointError, match="activation: checkpoint 'gelu_tanh', model 'gelu'"):
        other.load_checkpoint(tmp_path)


def test_a_skipped_step_is_logged_with_its_number_and_norm(caplog):
    mesh = ParallelMesh()
    model = TransformerModel(tiny(), mesh, seed=5)
    engine = plait.initialize(model, ds_config(2), mesh=mesh)
    dict(model.named_parameters())["layers.1.attn.q_proj.weight"].register_hook(lambda g: g * math.nan)
    with caplog.at_level("WARNING", logger="plait"):
        for j in range(GAS):
            engine.backward(engine(**micro_batch(0, j, 0)))
            engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 1   # taken and skipped, as DeepSpeed counts
    assert "optimizer step 1 skipped on every rank: global gradient norm is nan (1 in a row)" in caplog.text
