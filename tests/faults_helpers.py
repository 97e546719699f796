"""What the fault tests share (test_faults.py, test_input_faults.py, test_checkpoint_refusals.py,
test_step_faults.py): the step sizes, the ZeRO config with its non-finite guard, and a tp x pp engine with one
good step."""

import plait
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from helpers import micro_batch, tiny

STEPS, MICRO, GAS, SEQ, BAD_STEP = 4, 2, 2, 16, 1


def ds_config(stage, precision="fp32", guard=True, max_skips=10):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
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
            "reduce_bucket_size": 2000,
            "allgather_bucket_size": 3000,
            "stage3_param_persistence_threshold": 100,
        },
        "nonfinite_guard": {"enabled": guard, "max_consecutive_skips": max_skips},
    }
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _tp_pp_engine(tp, pp):
    """ZeRO-1 engine over tp x pp (1F1B) x dp, and its mesh."""
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel

    mesh = ParallelMesh(tp=tp, pp=pp)
    cfg = ds_config(1)
    cfg["tensor_parallel"] = {"size": tp}
    if pp > 1:
        cfg["pipeline"] = {"size": pp, "schedule": "1f1b"}
        model = PipelineParallel(
            build_stage_modules(tiny(), mesh, seed=5), mesh, schedule="1f1b", micro_batches=GAS
        )
    else:
        model = TransformerModel(tiny(), mesh, seed=5)
    return plait.initialize(model, cfg, mesh=mesh), mesh


def _good_step(engine, mesh):
    """One good step; returns this rank's whole weights."""
    engine.train_batch(iter([micro_batch(0, j, mesh.dp_rank) for j in range(GAS)]))
    with engine.optimizer.gathered_parameters():
        return {
            n: p.detach().clone()
            for c in (engine.pipeline.stage_modules if engine.pipeline else [engine.module])
            for n, p in c.named_parameters()
        }
