"""One arm of bench_offload.py, run in its own process: the Llama of a size (``SIZES``; a tiny one on the CPU),
the ds_config both frameworks read, a 1-rank process group, the training step of plait or DeepSpeed, the
phase-by-phase profile, and the timed row (``run_arm``)."""

from __future__ import annotations

import os
import time

import torch

SEQ = 2048
# name: (hidden, layers, heads, kv heads, ffn) -- Llama-style shapes (TinyLlama, Llama-2/3 family, between)
SIZES = {
    "1b": (2048, 22, 32, 4, 5632),
    "3b": (3200, 26, 32, 8, 8640),
    "5b": (4096, 24, 32, 8, 11008),
    "7b": (4096, 32, 32, 32, 11008),
    # Llama-3-8B's layers (hidden 4096, 32 layers, 8 kv heads, ffn 14336) with this table's vocabulary 32000
    # (not Llama-3's 128256): 7.24B parameters, so named by its count, not "8b"
    "7.2b": (4096, 32, 32, 8, 14336),
    "10b": (5120, 32, 40, 8, 13824),
    "13b": (5120, 40, 40, 40, 13824),
    "20b": (6144, 44, 48, 8, 16384),  # 17.56B parameters
    "21b": (6144, 52, 48, 8, 16384),  # 20.68B: the "20B or more" of issue 43
    "30b": (6656, 60, 52, 52, 17920),
    "70b": (8192, 80, 64, 8, 28672),  # Llama-2-70B: 68.98B parameters with vocabulary 32000
}


def model_config(size: str, device_type: str):
    from plait.models import preset

    if device_type == "cpu":  # smoke test: tiny shapes
        return preset(
            "llama-tiny",
            vocab_size=512,
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=128,
            max_position_embeddings=SEQ,
        )
    if size == "886m":
        return preset("llama-886m")
    h, layers, heads, kv, ffn = SIZES[size]
    return preset(
        "llama-886m",
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        max_position_embeddings=SEQ,
    )


def ds_config(stage: int, micro: int, offload_param: bool, clip: float = 1.0) -> dict:
    """The DeepSpeed config both arms read (plait reads ds_config JSON)."""
    zero = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 50_000_000,
        "allgather_bucket_size": 50_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        },
    }


def init_single_process(device: torch.device) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 1000))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def batch(cfg, device, micro: int, step: int) -> dict:
    g = torch.Generator(device=device).manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (micro, SEQ + 1), generator=g, device=device)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def make_step(
    framework: str,
    size: str,
    stage: int,
    micro: int,
    offload_param: bool,
    device: torch.device,
    clip: float = 1.0,
):
    """Returns (cfg, n_params, step_fn(i) -> loss, engine) for one arm."""
    from plait.layers import TransformerModel

    init_single_process(device)
    cfg = model_config(size, device.type)
    model = TransformerModel(cfg, None, seed=0, device=device)
    conf = ds_config(stage, micro, offload_param, clip)
    if framework == "plait":
        share = os.environ.get(
            "PLAIT_DEVICE_STEP"
        )  # plait.zero.offload.device_share; unset: plait's default
        if share is not None:
            conf["zero_optimization"]["offload_optimizer"]["device_step_fraction"] = (
                share if share == "auto" else float(share)
            )
        import plait
        from plait.parallel import ParallelMesh

        engine = plait.initialize(model, conf, mesh=ParallelMesh())
    elif framework == "ds":
        import deepspeed

        if device.type == "cuda":
            model = model.to(torch.bfloat16)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=conf
        )
    else:
        raise ValueError(f"unknown framework {framework!r}; use plait or ds")

    def step(i):
        loss = engine(**batch(cfg, device, micro, i))
        engine.backward(loss)
        engine.step()
        return loss

    return cfg, cfg.num_parameters(), step, engine


def profile_steps(framework, engine, cfg, device, micro: int, start: int, n: int = 3) -> dict:
    """Mean seconds per phase over ``n`` steps, each phase ended by a device synchronization."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    acc = {"forward": 0.0, "backward": 0.0, "step_call": 0.0, "host_step_wait": 0.0}
    sync()
    for i in range(start, start + n):
        t0 = time.perf_counter()
        loss = engine(**batch(cfg, device, micro, i))
        sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        if framework == "plait":
            engine.optimizer.synchronize()
        sync()
        t4 = time.perf_counter()
        for k, dt in zip(acc, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            acc[k] += dt / n
    return acc


def run_arm(
    framework: str,
    size: str,
    stage: int,
    micro: int,
    offload_param: bool,
    warmup: int,
    steps: int,
    device_type: str,
    clip: float = 1.0,
    profile: bool = False,
) -> dict:
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    t_init = time.perf_counter()
    cfg, n_params, step, engine = make_step(
        framework, size, stage, micro, offload_param, device, clip
    )
    init_s = time.perf_counter() - t_init
    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = step(i)
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    out = {
        "framework": framework,
        "size": size,
        "params": n_params,
        "tokens_per_s": micro * SEQ / dt,
        "step_s": dt,
        "init_s": init_s,
        "loss": float(loss),
        "clip": clip,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "host_rss_gib": _rss_gib(),
    }
    if profile:
        out["profile"] = profile_steps(framework, engine, cfg, device, micro, warmup + steps)
    share = getattr(getattr(getattr(engine, "optimizer", None), "stepper", None), "share", None)
    if framework == "plait" and share is not None:
        out["device_split_history"] = list(share.history)  # segments on the device, per step
    return out


def _rss_gib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0
