"""plait.initialize / Engine: ZeRO stages 0-3 combined with tensor parallelism, driven by a
DeepSpeed-style config, against a single-process torch.optim.AdamW reference on the same global
batch. Tolerance: every whole weight after 5 optimizer steps to 1e-6 relative (norm-relative,
||w - w_ref|| / ||w_ref||), float32."""

import pytest
import torch
import torch.distributed as dist

import plait
from plait.config import ConfigError
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.parallel.sharding import gather_logical_state
from plait.optim.schedulers import WarmupLR
from plait.testing import run_distributed
from plait.zero import weight_decay_groups
import helpers

STEPS, MICRO, GAS, SEQ = 5, 2, 2, 16


def tiny(**overrides):
    """This file's Llama: ``helpers.tiny`` with vocabulary 1001, hidden 64 and an MLP of 96."""
    return helpers.tiny(
        **{"vocab_size": 1001, "hidden_size": 64, "ffn_hidden_size": 96, **overrides}
    )


def ds_config(stage, tp):
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 3e-3,
                "warmup_num_steps": 3,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 3000,
            "allgather_bucket_size": 5000,
            "stage3_param_persistence_threshold": 100,
        },
        "tensor_parallel": {"size": tp},
    }


def micro_batch(step, gas, dp_rank):
    """``helpers.micro_batch`` over this file's vocabulary (1001)."""
    return helpers.micro_batch(step, gas, dp_rank, vocab_size=1001, micro=MICRO, seq=SEQ)


def reference(dp, arch_config=None, batch=None, losses_of=None):
    """Single process, plain torch AdamW on the tp=1 model, same global batch (dp x GAS micro-batches of
    ``batch(step, gas, dp_rank)``, default ``micro_batch``). ``losses_of(model, batch) -> (to differentiate,
    to report)``, default the model's loss for both."""
    batch = batch or micro_batch
    losses_of = losses_of or (lambda m, b: (m(**b),) * 2)
    model = TransformerModel(arch_config or tiny(), None, seed=5)
    opt = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = WarmupLR(opt, 0.0, 3e-3, 3, warmup_type="linear")
    losses = []
    for step in range(STEPS):
        total = 0.0
        for gas in range(GAS):
            for r in range(dp):
                loss, shown = losses_of(model, batch(step, gas, r))
                (loss / (GAS * dp)).backward()
                total += shown.item() / (GAS * dp)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(total)
    return gather_logical_state(model), losses


def engine_body(tp, device="cpu"):
    """Every ZeRO stage through the engine; ``device="cuda"`` runs it over NCCL
    (tests/gpu/run_engine_parity_nccl.py)."""
    results = {}
    for stage in (0, 1, 2, 3):
        mesh = ParallelMesh(tp=tp)
        # Built on CPU, then moved: initialization is layout-invariant per device type, and the
        # reference is a CPU model.
        model = TransformerModel(tiny(), mesh, seed=5).to(device)
        engine = plait.initialize(model, ds_config(stage, tp), mesh=mesh)
        losses = []
        for step in range(STEPS):
            batches = iter([micro_batch(step, gas, mesh.dp_rank) for gas in range(GAS)])
            losses.append(engine.train_batch(batches).item())
        with engine.optimizer.gathered_parameters():
            whole = {
                n: t.float().cpu() for n, t in gather_logical_state(model, mesh.tp_group).items()
            }
        results[stage] = (whole, losses, engine.global_steps, engine.get_lr()[0])
    return results if dist.get_rank() == 0 else None


def check_engine_results(results, ref_weights, ref_losses, tp, dp):
    for stage, (whole, losses, steps, lr) in results.items():
        assert steps == STEPS and lr == pytest.approx(3e-3)
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"stage {stage} loss curve"
        for name, ref in ref_weights.items():
            err = helpers.rel_err(whole[name], ref, floor=1e-12)
            assert err <= 1e-6, f"stage {stage} tp={tp} dp={dp}: {name} off by {err:.2e}"


@pytest.mark.parametrize("tp,world", [(2, 4), (1, 2)])
def test_engine_zero_stages_match_single_process_adamw(tp, world):
    dp = world // tp
    ref_weights, ref_losses = reference(dp)
    check_engine_results(
        run_distributed(engine_body, world, tp)[0], ref_weights, ref_losses, tp, dp
    )


def pipeline_body(arch, schedule, cp=1, method="ring", stages=None, ep=1):
    """pp=2 x dp=2 (or x cp=2 context parallel: each cp rank gets whole sequences, the engine keeps its
    chunks; or with the dp ranks' experts split over ep) through the engine, ZeRO stages 1-3, tied or untied
    embeddings."""
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel

    results = {}
    for stage in stages or STAGES_FOR[schedule]:
        mesh = ParallelMesh(tp=1, pp=2, cp=cp, ep=ep)
        v = 2 if schedule == "interleaved" else 1
        chunks = build_stage_modules(tiny_arch(arch), mesh, v=v, seed=5, cp_method=method)
        pipe = PipelineParallel(chunks, mesh, schedule=schedule, micro_batches=GAS)
        cfg = ds_config(stage, 1)
        cfg["pipeline"] = {"size": 2, "schedule": schedule, "virtual_stages": v}
        cfg["context_parallel"] = {"size": cp, "method": method}
        engine = plait.initialize(pipe, cfg, mesh=mesh)
        losses = [
            engine.train_batch(iter([micro_batch(s, g, mesh.dp_rank) for g in range(GAS)])).item()
            for s in range(STEPS)
        ]
        whole = {}
        with engine.optimizer.gathered_parameters():
            for chunk in chunks:
                whole.update(
                    {
                        n: t.float()
                        for n, t in gather_logical_state(chunk, ep_group=mesh.ep_group).items()
                    }
                )
        results[stage] = (whole, losses)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    return gathered if dist.get_rank() == 0 else None


def tiny_arch(arch):
    """Llama untied, or Llama with tied embeddings (no attention biases: a k_proj bias has an exactly
    zero gradient, which Adam turns into noise-sized steps no parity test can pin down); a config as is."""
    if not isinstance(arch, str):
        return arch
    return tiny() if arch == "llama" else tiny().replace(tie_embeddings=True)


STAGES_FOR = {"1f1b": (1, 2, 3), "interleaved": (1, 3), "zb-h1": (1, 2, 3)}


@pytest.mark.parametrize(
    "arch,schedule", [("llama-tied", "1f1b"), ("llama", "zb-h1"), ("llama-tied", "interleaved")]
)
def test_engine_with_pipeline_and_zero_matches_single_process(arch, schedule):
    ref_weights, ref_losses = reference(2, tiny_arch(arch))
    per_rank = run_distributed(pipeline_body, 4, arch, schedule)[0]
    check_pipeline_results(per_rank, STAGES_FOR[schedule], ref_weights, ref_losses, f"pp=2 {arch}")


def check_pipeline_results(per_rank, stages, ref_weights, ref_losses, what, tol=1e-6):
    """Every rank's stage weights together (and rank 0's loss curve) against the reference: weights to ``tol``."""
    for stage in stages:
        whole = {}
        for rank_results in per_rank:
            whole.update(rank_results[stage][0])
        assert per_rank[0][stage][1] == pytest.approx(ref_losses, rel=1e-5)
        assert set(whole) >= set(ref_weights)
        for name, ref in ref_weights.items():
            err = helpers.rel_err(whole[name], ref, floor=1e-12)
            assert err <= tol, f"{what} ZeRO stage {stage}: {name} off by {err:.2e}"


def test_misspelt_key_fails_with_suggestion():
    model = TransformerModel(tiny(), None)
    with pytest.raises(ConfigError, match="did you mean 'gradient_accumulation_steps'"):
        plait.initialize(
            model, {"train_micro_batch_size_per_gpu": 1, "gradient_acumulation_steps": 2}
        )


def lamb_body(tp, fused):
    """LAMB's per-tensor trust ratio must survive ZeRO flattening and tp sharding (and, with ``fused``, the
    fused q/k/v and gate/up parameters: each logical tensor keeps its own ratio)."""
    out = {}
    for stage in (0, 2, 3):
        mesh = ParallelMesh(tp=tp)
        model = TransformerModel(tiny(fused_projections=fused), mesh, seed=5)
        cfg = ds_config(stage, tp)
        cfg.update(
            optimizer={"type": "LAMB", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            scheduler=None,
            gradient_clipping=0.0,
        )
        cfg = {k: v for k, v in cfg.items() if v is not None}
        engine = plait.initialize(model, cfg, mesh=mesh)
        for step in range(3):
            engine.train_batch(iter([micro_batch(step, gas, mesh.dp_rank) for gas in range(GAS)]))
        with engine.optimizer.gathered_parameters():
            out[stage] = {
                n: t.float() for n, t in gather_logical_state(model, mesh.tp_group).items()
            }
    return out if dist.get_rank() == 0 else None


@pytest.mark.parametrize("fused", [False, True])
def test_lamb_under_zero_and_tp_matches_per_tensor_lamb(fused):
    from plait.optim.lamb import Lamb

    # Unfused: torch-style LAMB takes one trust ratio per logical tensor (q, k, v each), as the engine does
    model = TransformerModel(tiny(fused_projections=False), None, seed=5)
    opt = Lamb(weight_decay_groups(model, 0.01), lr=1e-2, eps=1e-8)
    for step in range(3):
        for gas in range(GAS):
            for r in range(2):
                (model(**micro_batch(step, gas, r)) / (GAS * 2)).backward()
        opt.step()
        opt.zero_grad()
    ref = gather_logical_state(model)
    for stage, whole in run_distributed(lamb_body, 4, 2, fused)[0].items():
        for name, w in ref.items():
            err = helpers.rel_err(whole[name], w)
            assert err <= 1e-6, f"LAMB stage {stage}: {name} off by {err:.2e}"


def grad_norm_body():
    """tp=2 x pp=2 x dp=2: the engine's global gradient norm (before clipping) of one step."""
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel

    mesh = ParallelMesh(tp=2, pp=2)
    arch = tiny().replace(tie_embeddings=True)
    pipe = PipelineParallel(
        build_stage_modules(arch, mesh, seed=5), mesh, "1f1b", micro_batches=GAS
    )
    cfg = ds_config(1, 2)
    cfg["pipeline"] = {"size": 2, "schedule": "1f1b"}
    engine = plait.initialize(pipe, cfg, mesh=mesh)
    engine.train_batch(iter([micro_batch(0, g, mesh.dp_rank) for g in range(GAS)]))
    return engine.grad_norm


def test_global_grad_norm_under_tp_pp_dp_equals_single_process():
    """Reference: the single-process model in float64 (the float32 single-process norm itself is off
    by ~2e-6 from it, so float64 is the fair judge at 1e-6)."""
    model = TransformerModel(tiny().replace(tie_embeddings=True), None, seed=5).double()
    for gas in range(GAS):
        for r in range(2):
            (model(**micro_batch(0, gas, r)) / (GAS * 2)).backward()
    ref = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    norms = run_distributed(grad_norm_body, 8)
    assert all(n == pytest.approx(ref, rel=1e-6) for n in norms), (norms, ref)


def test_activation_checkpointing_config_recomputes_blocks_and_accepts_megatrons_variants(caplog):
    model = TransformerModel(tiny(), None, seed=5)
    base = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine = plait.initialize(
        model, {**base, "activation_checkpointing": {"number_checkpoints": 1}}
    )
    assert [model.layers[str(i)].recompute for i in (1, 2)] == ["full", None]
    loss = engine(**micro_batch(0, 0, 0))
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
    # Megatron's CPU / partitioned checkpoints only move the saved activations: accepted, with a notice
    plait.initialize(
        TransformerModel(tiny(), None),
        {**base, "activation_checkpointing": {"cpu_checkpointing": True}},
    )
    assert "activation_checkpointing.cpu_checkpointing is accepted" in caplog.text


def test_keep_last_prunes_old_checkpoints(tmp_path):
    from plait.checkpoint import list_tags

    engine = plait.initialize(
        TransformerModel(tiny(), None, seed=5),
        {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    for step in range(3):
        engine.train_batch(iter([micro_batch(step, 0, 0)]))
        engine.save_checkpoint(tmp_path, keep_last=2)
    assert sorted(list_tags(str(tmp_path))) == ["global_step2", "global_step3"]


def bf16_pipeline_body():
    """ZeRO casts the pipeline's chunks to bf16 after the pipeline was built: activations must travel
    in bf16 too (the first NCCL run of the pretraining script found this)."""
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel

    mesh = ParallelMesh(pp=2)
    pipe = PipelineParallel(
        build_stage_modules(tiny(), mesh, seed=5), mesh, "1f1b", micro_batches=GAS
    )
    cfg = ds_config(1, 1)
    cfg.update(pipeline={"size": 2}, bf16={"enabled": True})
    engine = plait.initialize(pipe, cfg, mesh=mesh)
    losses = [
        engine.train_batch(iter([micro_batch(s, g, 0) for g in range(GAS)])).item()
        for s in range(3)
    ]
    return losses, engine.eval_batch(iter([micro_batch(9, g, 0) for g in range(GAS)])).item()


def test_bf16_pipeline_through_the_engine_tracks_fp32():
    _, ref_losses = reference(1)
    losses, eval_loss = run_distributed(bf16_pipeline_body, 2)[0]
    assert losses == pytest.approx(ref_losses[:3], rel=2e-2)  # bf16 weights: ~1% of the fp32 curve
    assert eval_loss == eval_loss and eval_loss < losses[0]


def test_user_optimizer_class_and_scheduler_factory():
    """Any torch optimizer (class) and any torch scheduler (as a factory over ZeRO's optimizer); a
    scheduler *instance* bound to another optimizer is refused."""
    base = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    import functools

    engine = plait.initialize(
        TransformerModel(tiny(), None, seed=5),
        base,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
    )
    for step in range(2):
        engine.train_batch(iter([micro_batch(step, 0, 0)]))
    assert isinstance(engine.optimizer.optimizer, torch.optim.SGD)
    assert engine.get_lr() == pytest.approx([0.025, 0.025])
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(TypeError, match="pass lr_scheduler as a factory"):
        plait.initialize(
            TransformerModel(tiny(), None),
            base,
            optimizer=torch.optim.SGD,
            lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1),
        )
