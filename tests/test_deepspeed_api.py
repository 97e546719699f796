"""``import plait.deepspeed as deepspeed``: DeepSpeed's engine API on plait, checked against torch run by
hand (single process, float32); on two gloo ranks and under torchrun: tests/test_deepspeed_api_ranks.py.

Tolerances: plait's step runs torch's AdamW on fp32 master copies of the same values, in the same
order, with the same float32 gradient, so a few steps agree to rounding (1e-6; torch's own foreach
and single-tensor AdamW differ by ~1e-7 over these steps). The errors these tests guard against are
three orders larger: decaying only matrices where DeepSpeed decays every parameter moves weights by
~1e-4 per step at lr 1e-2 and weight decay 0.1; a schedule left on the user's optimizer keeps the lr
constant; an edit dropped at exit is a whole-row difference.
"""

import argparse

import pytest
import torch

import plait.deepspeed as deepspeed
from plait.config import ConfigError
from deepspeed_api_helpers import batch, bert, ds_config

TOL = 1e-6


@pytest.fixture(autouse=True)
def no_group_left_behind():
    """deepspeed.initialize starts a one-process group as DeepSpeed does; later tests expect none."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def torch_reference(steps, gas=1, decay_all=True, schedule=None):
    """The same training by hand: torch AdamW over every parameter (one group, as DeepSpeed builds it)."""
    model = bert()
    params = list(model.parameters())
    if decay_all:
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() >= 2]},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=1e-2,
            weight_decay=0.1,
        )
    sched = schedule(opt) if schedule else None
    for step in range(steps):
        for micro in range(gas):
            (model(**batch(step * gas + micro)).loss / gas).backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def train(engine, steps, gas=1):
    for step in range(steps):
        for micro in range(gas):
            engine.backward(engine(**batch(step * gas + micro)).loss)
            engine.step()


def max_diff(engine, ref):
    with engine.gathered_parameters():
        return max(
            (p.detach() - ref[n]).abs().max().item() for n, p in engine.module.named_parameters()
        )


def test_initialize_returns_deepspeeds_four_tuple_and_engine_members():
    model = bert()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(),
        training_data=[batch(i, n=1)["input_ids"][0] for i in range(6)],
    )
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler is None
    assert (
        engine.device == torch.device("cpu") and engine.local_rank == 0 and engine.global_rank == 0
    )
    assert (
        engine.zero_optimization_stage() == 2
        and not engine.fp16_enabled()
        and not engine.bfloat16_enabled()
    )
    assert sum(p.numel() for p in engine.parameters()) == sum(p.numel() for p in model.parameters())
    sizes = [len(b) for b in loader]
    assert sizes == [2, 2, 2]  # micro-batches of train_micro_batch_size_per_gpu
    assert engine.train() is engine and engine.module.training


def test_model_parameters_decay_every_parameter_as_deepspeed():
    """DeepSpeed hands model.parameters() to AdamW as one group: biases and norm weights decay too."""
    model = bert()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config()
    )
    train(engine, 3)
    assert max_diff(engine, torch_reference(3)) <= TOL
    assert (
        max_diff(engine, torch_reference(3, decay_all=False)) > 100 * TOL
    )  # the old grouping is visibly different


def test_model_parameters_none_means_every_parameter():
    engine, *_ = deepspeed.initialize(model=bert(), config=ds_config())
    train(engine, 2)
    assert max_diff(engine, torch_reference(2)) <= TOL


def test_optimizer_and_schedule_instances_are_used():
    """An AdamW instance and a LambdaLR bound to it (get_linear_schedule_with_warmup's kind) keep working."""
    model = bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    lam = lambda step: min(1.0, (step + 1) / 3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    cfg = {k: v for k, v in ds_config().items() if k != "optimizer"}
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=cfg
    )
    assert scheduler is sched and sched.optimizer is optimizer.optimizer
    train(engine, 3)
    assert engine.get_lr() == pytest.approx([1e-2 * lam(3)])
    ref = torch_reference(3, schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lam))
    assert max_diff(engine, ref) <= TOL


def test_config_from_args_and_conflicts(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(__import__("json").dumps(ds_config()))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, *_ = deepspeed.initialize(args=args, model=bert())
    assert engine.zero_optimization_stage() == 2
    with pytest.raises(ConfigError, match="config_params"):
        deepspeed.initialize(model=bert(), config=ds_config(), config_params=ds_config())
    with pytest.raises(ConfigError, match="args.deepspeed_config"):
        deepspeed.initialize(args=args, model=bert(), config=ds_config())
    with pytest.raises(ConfigError, match="needs a ds_config"):
        deepspeed.initialize(model=bert())
    with pytest.raises(ValueError, match="mpu"):
        deepspeed.initialize(model=bert(), config=ds_config(), mpu=object())


def test_gradient_accumulation_boundary_override_steps_a_short_accumulation():
    """GAS 4, boundary forced after 2 micro-batches: the step uses those two, each scaled by 1/4."""
    engine, *_ = deepspeed.initialize(model=bert(), config=ds_config(gas=4))
    for micro in range(2):
        engine.set_gradient_accumulation_boundary(micro == 1)
        engine.backward(engine(**batch(micro)).loss)
        engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    model = bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for micro in range(2):
        (model(**batch(micro)).loss / 4).backward()
    opt.step()
    assert max_diff(engine, {n: p.detach() for n, p in model.named_parameters()}) <= TOL


def test_fp16_skipped_step_counts_in_global_steps():
    """DeepSpeed counts an overflow-skipped step in global_steps and in skipped_steps."""
    cfg = ds_config(stage=1, fp16={"enabled": True, "initial_scale_power": 4})
    engine, *_ = deepspeed.initialize(model=bert(), config=cfg)
    engine.backward(engine(**batch(0)).loss * float("inf"))
    engine.step()
    assert (engine.global_steps, engine.skipped_steps, engine.was_step_applied()) == (1, 1, False)
    engine.backward(engine(**batch(1)).loss)
    engine.step()
    assert (engine.global_steps, engine.skipped_steps, engine.was_step_applied()) == (2, 1, True)


def test_save_16bit_model_loads_into_a_fresh_model(tmp_path):
    engine, *_ = deepspeed.initialize(
        model=bert(),
        config=ds_config(
            stage=3,
            bf16={"enabled": True},
            zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        ),
    )
    train(engine, 2)
    assert engine.save_16bit_model(tmp_path, "model.safetensors")
    assert engine.save_16bit_model(tmp_path)
    from safetensors.torch import load_file

    for state in (
        load_file(tmp_path / "model.safetensors"),
        torch.load(tmp_path / "pytorch_model.bin"),
    ):
        fresh = bert().to(torch.bfloat16)
        missing, unexpected = fresh.load_state_dict(state, strict=False)
        assert not unexpected and all(
            "decoder." in m for m in missing
        )  # tied head tensors are stored once
        with engine.gathered_parameters():
            for n, p in engine.module.named_parameters():
                assert torch.equal(dict(fresh.named_parameters())[n], p.detach()), n


def test_save_16bit_model_at_stage3_needs_the_gather_switch(tmp_path, caplog):
    engine, *_ = deepspeed.initialize(model=bert(), config=ds_config(stage=3))
    assert engine.save_16bit_model(tmp_path) is False
    assert not (tmp_path / "pytorch_model.bin").exists()
    assert "stage3_gather_16bit_weights_on_model_save" in caplog.text


def test_keeping_an_edit_leaves_the_other_fp32_master_weights_bit_for_bit():
    """bf16 compute: the gathered parameters are the masters rounded to bf16; writing them back whole would
    round every master weight (a 1e-3 relative change), so only the edited elements are taken."""
    engine, *_ = deepspeed.initialize(model=bert(), config=ds_config(3, bf16={"enabled": True}))
    train(engine, 2)
    before = [m.detach().clone() for m in engine.optimizer.masters]
    emb = engine.module.bert.embeddings.word_embeddings.weight
    with deepspeed.zero.GatheredParameters([emb], modifier_rank=0):
        emb.data[3].fill_(0.5)
    after = [m.detach() for m in engine.optimizer.masters]
    changed = sum(int((a != b).sum()) for a, b in zip(after, before))
    assert changed == emb.shape[1]  # the edited row, nothing else
    with engine.gathered_parameters():
        assert torch.equal(emb.detach()[3].float(), torch.full((emb.shape[1],), 0.5))


def test_initialize_leaves_torchs_generator_as_the_script_set_it_unless_the_config_sets_a_seed():
    """DeepSpeed's initialize seeds nothing: a script's torch.manual_seed(args.seed) goes on into its dropout and
    shuffling (before, plait seeded 1234 whatever the script set, so a seed sweep drew the same streams). A config
    with "seed" seeds torch's generators with it."""
    model = bert()
    torch.manual_seed(42)
    before = torch.get_rng_state()
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    assert torch.equal(torch.get_rng_state(), before)
    deepspeed.initialize(model=bert(), config=ds_config(seed=7))
    drawn = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(4))
