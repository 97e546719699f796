"""Faults that used to stop or silently spoil a step (issue 41, items 4, 11, 12, 13), CPU (gloo for 2 ranks).

* A bad micro-batch seen by one rank only: every rank drops the step and raises the same error naming the
  rank(s) and the problem, and training goes on in step (forward/backward/step, a pipeline, evaluation).
* fp16 whose loss scale cannot recover (static, or dynamic at ``min_loss_scale``) overflowing every step:
  ``nonfinite_guard.max_consecutive_skips`` ends the run naming the scale and the keys to change.
* int32 token ids and labels train exactly as int64 ones.
* A sequence longer than the model's positions is refused naming both numbers, for plait's models and
  Hugging Face ones, unless the config says how RoPE positions extrapolate (``rope_scaling``).
"""

import pytest
import torch
import torch.distributed as dist
import transformers

import plait
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from plait.zero.precision import NonFiniteError
from helpers import micro_batch, tiny
from faults_helpers import GAS, _good_step, _tp_pp_engine, ds_config

HEAD = "(every rank stops this step, nothing of it applied, and raises this error)"


def _dp_engine():
    mesh = ParallelMesh()
    model = TransformerModel(tiny(max_position_embeddings=16), mesh, seed=5)
    return plait.initialize(model, ds_config(2), mesh=mesh), mesh


def _bad(batches, j, key, where, value):
    batches[j] = {k: v.clone() for k, v in batches[j].items()}
    batches[j][key][where] = value
    return batches


def _manual_step(engine, batches):
    """forward/backward/step over ``batches``; the error's text, or None."""
    try:
        for b in batches:
            engine.backward(engine(**b))
            engine.step()
    except ValueError as err:
        return str(err)
    return None


def _dp_body():
    """dp 2, ZeRO-2 (gradients reduced during backward, so a rank that stops alone desynchronizes at once)."""
    engine, mesh = _dp_engine()
    r, out = mesh.dp_rank, {}
    batches = [micro_batch(0, j, r) for j in range(GAS)]
    out["one"] = _manual_step(
        engine, _bad(batches, 0, "input_ids", (1, 3), 257) if r == 1 else batches
    )
    batches = [
        micro_batch(0, j, r, seq=17 if r == 1 else 16) for j in range(GAS)
    ]  # rank 1: too long
    out["two"] = _manual_step(
        engine, _bad(batches, 1, "labels", (0, 2), 300) if r == 0 else batches
    )
    out["leftover"] = engine.optimizer.micro_steps
    batches = [micro_batch(1, j, r) for j in range(GAS)]
    try:
        engine.eval_batch(iter(_bad(batches, 1, "labels", (0, 0), -5) if r == 1 else batches))
        out["eval"] = None
    except ValueError as err:
        out["eval"] = str(err)
    out["after"], out["steps"] = _good_step(engine, mesh), engine.global_steps
    out["fresh"] = _good_step(*_dp_engine())
    return out


def _pipeline_body():
    """pp 2: the last stage's rank pulls a bad micro-batch, the first stage's a good one."""
    engine, mesh = _tp_pp_engine(1, 2)
    batches = [micro_batch(0, j, 0) for j in range(GAS)]
    try:
        engine.train_batch(
            iter(_bad(batches, 1, "labels", (0, 1), 999) if dist.get_rank() == 1 else batches)
        )
        msg = None
    except ValueError as err:
        msg = str(err)
    return {
        "msg": msg,
        "after": _good_step(engine, mesh),
        "steps": engine.global_steps,
        "fresh": _good_step(*_tp_pp_engine(1, 2)),
    }


def _one_rank_body():
    return _dp_body(), _pipeline_body()


@pytest.fixture(scope="module")
def one_rank_results():
    return run_distributed(_one_rank_body, 2, timeout_s=90)


def _same_weights(out):
    return out["after"].keys() == out["fresh"].keys() and all(
        torch.equal(out["after"][n], out["fresh"][n]) for n in out["fresh"]
    )


def test_a_bad_micro_batch_on_one_rank_drops_the_step_on_every_rank(one_rank_results):
    (dp0, _), (dp1, _) = one_rank_results
    for key in ("one", "two", "eval"):
        assert dp0[key] == dp1[key], key  # one message, the same on every rank
    assert dp0["one"].startswith(
        f"a bad micro-batch on rank 1 of 2 {HEAD}: input_ids[1, 3] = 257 is outside "
        "the model's vocabulary"
    ), dp0["one"]
    assert dp0["two"].startswith(
        f"a bad micro-batch on ranks 0, 1 of 2 {HEAD}: rank 0: labels[0, 2] = 300 is "
        "outside the model's vocabulary"
    ), dp0["two"]
    assert (
        "; rank 1: input_ids holds sequences of 17 tokens (shape [2, 17]) but the model's "
        "max_position_embeddings is 16: cut the sequences" in dp0["two"]
    )
    assert dp0["eval"].startswith(
        f"a bad micro-batch on rank 1 of 2 {HEAD}: labels[0, 0] = -5 is outside"
    ), dp0["eval"]
    for out in (dp0, dp1):
        assert (
            out["leftover"] == 0 and out["steps"] == 1 and _same_weights(out)
        )  # only the good step applied


def test_a_bad_micro_batch_pulled_by_one_pipeline_stage_stops_both(one_rank_results):
    (_, pp0), (_, pp1) = one_rank_results
    assert pp0["msg"] == pp1["msg"] and pp0["msg"].startswith(
        f"a bad micro-batch on rank 1 of 2 {HEAD}: labels[0, 1] = 999 is outside"
    ), pp0["msg"]
    for out in (pp0, pp1):
        assert out["steps"] == 1 and _same_weights(out)


# ---- item 11: a loss scale that cannot recover ---------------------------------------------------------
def _fp16_engine(fp16: dict, max_skips: int):
    cfg = ds_config(1, max_skips=max_skips)
    cfg["fp16"] = {"enabled": True, **fp16}
    mesh = ParallelMesh()
    return plait.initialize(TransformerModel(tiny(), mesh, seed=5), cfg, mesh=mesh)


def _train(engine, step):
    engine.train_batch(iter([micro_batch(step, j, 0) for j in range(GAS)]))


def test_a_static_loss_scale_that_always_overflows_ends_the_run_naming_the_key(caplog):
    engine = _fp16_engine({"loss_scale": 2**40}, max_skips=3)
    with caplog.at_level("WARNING", logger="plait"):
        for step in range(2):
            _train(engine, step)
        with pytest.raises(NonFiniteError) as err:
            _train(engine, 2)
    assert (
        "optimizer step 2 skipped on every rank: global gradient norm is nan (2 in a row)"
        in caplog.text
    )
    msg = str(err.value)
    assert msg.startswith(
        "3 optimizer steps in a row (up to step 3) had an inf/nan global gradient norm"
    ), msg
    assert (
        "overflow at the static loss scale 1.09951e+12 (fp16.loss_scale), which never changes"
        in msg
    )
    assert "set fp16.loss_scale to 0 (a dynamic scale" in msg and "bf16.enabled: true" in msg
    assert "max_consecutive_skips (now 3)" in msg


def test_a_dynamic_loss_scale_at_its_floor_ends_the_run_naming_the_key():
    engine = _fp16_engine(
        {"initial_scale_power": 40, "min_loss_scale": 2**40, "hysteresis": 2}, max_skips=1
    )
    with pytest.raises(
        NonFiniteError,
        match=r"at the dynamic loss scale's floor 1.09951e\+12 \(fp16.min_loss_scale\)"
        r".*lower fp16.min_loss_scale, or train in bf16",
    ):
        _train(engine, 0)


def test_a_falling_dynamic_loss_scale_is_not_ended():
    engine = _fp16_engine({"initial_scale_power": 40, "hysteresis": 1}, max_skips=3)
    step = 0
    while engine.global_steps == engine.skipped_steps:  # no step applied yet
        _train(engine, step)
        step += 1
    assert engine.skipped_steps > 3 and engine.loss_scale < 2**40


# ---- item 12: int32 ids ---------------------------------------------------------------------------------
def test_int32_ids_and_labels_give_the_int64_loss_bitwise():
    mesh = ParallelMesh()
    engine = plait.initialize(TransformerModel(tiny(), mesh, seed=5), ds_config(1), mesh=mesh)
    batch = {k: v.clone() for k, v in micro_batch(0, 0, 0).items()}
    batch["labels"][0, :4] = -100
    narrow = {k: v.int() for k, v in batch.items()}
    assert torch.equal(engine(**narrow), engine(**batch))
    from plait.engine.batch import BatchLimits, check_micro_batch  # the pipeline's check: int64 out

    assert all(
        v.dtype == torch.int64 for v in check_micro_batch(narrow, BatchLimits(257, 256)).values()
    )


# ---- item 13: positions ---------------------------------------------------------------------------------
def _steps_of(model, seq, **extra):
    """Train one step on sequences of ``seq`` tokens; the engine's global_steps."""
    engine = plait.initialize(model, ds_config(1), mesh=ParallelMesh())
    batches = [{**micro_batch(0, j, 0, seq=seq, vocab_size=64), **extra} for j in range(GAS)]
    engine.train_batch(iter(batches))
    return engine.global_steps


def _hf_llama(**extra):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            **extra,
        )
    )


TOO_LONG = r"input_ids holds sequences of 17 tokens \(shape \[2, 17\]\) but the model's max_position_embeddings is 16"


@pytest.mark.parametrize("family", ["plait llama", "hf llama", "hf gpt2"])
def test_a_sequence_longer_than_the_positions_is_refused_naming_both(family):
    if family == "plait llama":  # RoPE: trained silently before
        model = TransformerModel(
            tiny(max_position_embeddings=16, vocab_size=64), ParallelMesh(), seed=5
        )
    elif family == "hf llama":
        model = _hf_llama()
    else:  # a learned table: torch's bare IndexError before
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16)
        )
    with pytest.raises(ValueError, match=TOO_LONG):
        _steps_of(model, 17)


def test_positions_past_the_table_are_refused_and_rope_scaling_extrapolates():
    model = TransformerModel(
        tiny(max_position_embeddings=16, vocab_size=64), ParallelMesh(), seed=5
    )
    with pytest.raises(
        ValueError,
        match=r"position_ids\[0, 15\] = 16 is outside the model's positions: position "
        r"ids must be in \[0, 16\)",
    ):
        _steps_of(model, 16, position_ids=torch.arange(1, 17).expand(2, 16))
    assert _steps_of(_hf_llama(rope_scaling={"rope_type": "linear", "factor": 2.0}), 24) == 1
    from plait.engine.batch import BatchLimits, batch_limits

    assert batch_limits(_hf_llama().config) == BatchLimits(64, 16)
    assert batch_limits(None) == BatchLimits(None, None)


def test_an_odd_length_sequence_trains_at_cp_1():
    """RoPE positions at cp 1 are the whole sequence's, of any length (cp > 1 needs 2 x cp chunks)."""
    assert _steps_of(TransformerModel(tiny(vocab_size=64), ParallelMesh(), seed=5), 15) == 1
