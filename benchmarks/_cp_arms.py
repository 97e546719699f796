"""The arms of bench_context_parallel.py, run on each rank of their own ``torch.distributed.run`` group: plait
at cp 1 or 2 (ring or all-to-all) through ``plait.initialize``, torch's ``context_parallel`` over FSDP2, and
the timed steps that make the row (``run_arm``)."""

from __future__ import annotations

import time

import torch

from _common import BETAS, CLIP, LR, PEAK_FLOPS, WEIGHT_DECAY, batch, ds_like_config
from _common import fsdp2_wrap, model_flops_per_token


CP_METHODS = {"plait-ring": "ring", "plait-a2a": "all_to_all", "plait-ring-tiled": "ring"}


def cp_size(arm: str) -> int:
    """GPUs (= cp ranks) of an arm."""
    return 1 if arm in ("plait-cp1", "plait-tiled") else 2


def model_config(arm: str, model: str, seq: int):
    from bench_long_seq import TILES
    from plait.models import preset

    return preset(model, max_position_embeddings=seq, **(TILES if arm.endswith("tiled") else {}))


def same_batch(cfg, device, step: int, seq: int) -> dict:
    """``_common.batch`` drawn on the CPU (the same on every rank whatever its GPU), then moved to ``device``."""
    return {k: v.to(device) for k, v in batch(cfg, "cpu", step, micro=1, seq=seq).items()}


def plait_arm(arm, cfg, device, seq):
    """plait through ``plait.initialize`` (ZeRO-3, AC of every block), at cp 1 or 2; a step function."""
    import plait
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh

    cp = cp_size(arm)
    conf = ds_like_config(3)
    conf["train_micro_batch_size_per_gpu"] = 1
    conf["activation_checkpointing"] = {"number_checkpoints": cfg.num_layers}  # every block
    if cp == 1:
        model, mesh = TransformerModel(cfg, None, seed=0, device=device), ParallelMesh()
    else:
        mesh = ParallelMesh(cp=cp)
        model = TransformerModel(cfg, mesh, seed=0, device=device, cp_method=CP_METHODS[arm])
        conf["context_parallel"] = {"size": cp, "method": CP_METHODS[arm]}
    engine = plait.initialize(model, conf, mesh=mesh)

    def step(i):
        loss = engine(
            **same_batch(cfg, device, i, seq)
        )  # whole sequences: the engine keeps this rank's chunks
        engine.backward(loss)
        engine.step()
        return loss

    return step


def torch_cp_arm(arm, cfg, device, seq):
    """HandLlama + FSDP2 + AC under ``torch.distributed.tensor.experimental.context_parallel``; a step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend

    from bench_zero import torch_model
    from hand_llama import Block

    torch.manual_seed(0)
    model, _ = torch_model(cfg, device, ac=True, compiled=False)
    for block in model.modules():
        if isinstance(block, Block):
            block.repeat_kv = arm.endswith("-repkv")
    fsdp2_wrap(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, fused=True
    )
    group = dist.new_group(list(range(dist.get_world_size())))  # K/V apart from FSDP's collectives
    mesh = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("cp",))
    set_rotate_method("allgather")
    heads, kv, d = (
        cfg.num_heads,
        cfg.num_heads if arm.endswith("-repkv") else cfg.num_kv_heads,
        cfg.head_dim,
    )
    q, k = (
        torch.empty(1, n, seq // 2, d, device=device, dtype=torch.bfloat16) for n in (heads, kv)
    )
    choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, enable_gqa=heads != kv)
    print(
        f"torch-cp: SDPA picks {SDPBackend(choice).name} for this rank's q {list(q.shape)}, k {list(k.shape)}",
        flush=True,
    )

    def step(i):
        b = same_batch(cfg, device, i, seq)
        # buffers of their own storage: context_parallel shards them in place (resize_ + copy_)
        ids, labels = b["input_ids"].clone(), b["labels"].clone()
        pos = torch.arange(seq, device=device).unsqueeze(0)
        buffers = [ids, labels, pos]
        with context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
        ):
            loss = model(
                ids, labels, position_ids=pos
            )  # this rank's mean; FSDP averages the 2 ranks' grads
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def run_arm(arm: str, args) -> dict:
    """On every rank: one warm-up step, ``--steps`` timed steps; rank 0 returns the row."""
    import torch.distributed as dist

    from bench_zero import init_distributed

    torch.backends.cuda.matmul.allow_tf32 = True
    device, seq = init_distributed(), args.seq
    cfg = model_config(arm, args.model, seq)
    step = (torch_cp_arm if arm.startswith("torch-") else plait_arm)(arm, cfg, device, seq)
    t0 = time.perf_counter()
    step(0)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        loss = step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    world, cp = dist.get_world_size(), cp_size(arm)
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    total = loss.detach().float().clone()
    dist.all_reduce(
        total
    )  # the mean over the ranks (plait: each rank's is the sequence's; torch: its shard's)
    n = cfg.num_parameters()
    tokens_gpu = (
        seq * (world // cp) / dt / world
    )  # one sequence per dp rank per step, over all GPUs
    return {
        "arm": arm,
        "model": args.model,
        "nproc": world,
        "cp": cp,
        "seq": seq,
        "tokens_per_s_gpu": tokens_gpu,
        "mfu": tokens_gpu * model_flops_per_token(cfg, n, seq) / PEAK_FLOPS,
        "peak_gib": peak.item() / 2**30,
        "step_s": dt,
        "warmup_s": first,
        "loss": total.item() / world,
        "params": n,
        "steps": args.steps,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }
