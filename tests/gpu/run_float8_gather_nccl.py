"""ZeRO-3's float8 all-gather (``fp8.float8_all_gather``) over NCCL on 2 GPUs, with torchao's real float8 GEMMs.

    torchrun --nproc-per-node 2 tests/gpu/run_float8_gather_nccl.py

plait's llama-tiny (dimensions of 16s) at ZeRO-3 over 2 dp ranks, float8 tensorwise, 6 micro-batches, gathers
prefetched, blocks recomputed:
(1) eager, the float8 gather's losses equal the bf16 gather's bit for bit (the same amax of the whole weight,
    hence the same float8 values and scale; on the GPU the cast is compiled into one kernel, which must give
    torchao's eager bytes: ``plait.precision.float8_gather``);
(2) ``Float8Gather.narrow`` never makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode("error")``
    from the second micro-batch on; the first compiles the cast): a wait there stops the host queueing the
    prefetches ahead of the blocks (a write indexed by a Python list, which copies its index from host to
    device and synchronizes, made the float8 gather 0.88x the bf16 gather's tokens/s on 2 H200s:
    ``benchmarks/results/float8_gather_2xH200.md``); such a write is shown failing the check;
(3) compiled with inductor, both run and their losses are printed (inductor fuses torchao's cast of a
    bf16-gathered weight into its own kernels, so the two may differ in the last bits).
Rank 0 prints one line per check; exit status 1 if one fails.
"""

import sys

import torch
import torch.distributed as dist

import plait
from plait.layers import TransformerModel
from plait.models import preset
from plait.parallel import ParallelMesh, init_distributed
from plait.precision.float8_gather import Float8Gather

STEPS = 3


def train(float8_all_gather: bool, compiled: bool, check_syncs: bool = False) -> list[float]:
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "overlap_comm": True,
            "stage3_prefetch_bucket_size": 10**6,
        },
        "fp8": {"enabled": True, "float8_all_gather": float8_all_gather},
        "activation_checkpointing": {"number_checkpoints": 4},
    }
    if compiled:
        config["compile"] = {"enabled": True}
    mesh = ParallelMesh()
    narrow = Float8Gather.narrow
    engine = plait.initialize(
        TransformerModel(preset("llama-tiny"), None, seed=3), config, mesh=mesh
    )
    losses = []
    try:
        for step in range(STEPS * 2):
            if (
                check_syncs and step == 1
            ):  # after the first micro-batch, which compiles the GPU cast
                Float8Gather.narrow = checked_narrow(narrow)
            g = torch.Generator(device="cuda").manual_seed(100 * step + mesh.dp_rank)
            ids = torch.randint(0, 8192, (2, 129), generator=g, device="cuda")
            loss = engine(input_ids=ids[:, :-1], labels=ids[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        Float8Gather.narrow = narrow
    return losses


def checked_narrow(narrow):
    """``narrow`` under the sync debug mode "error": any call that makes the host wait for the GPU raises."""

    def run(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return narrow(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return run


def broken_write_is_caught() -> bool:
    """The check catches the kind of write the float8 gather once made: a tensor indexed by a Python list."""
    amax = torch.zeros(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        amax[[0, 2]] = torch.ones(2, device="cuda")
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


def main() -> int:
    info = init_distributed(backend="nccl")
    failures, lines = 0, []
    try:
        eager = {f8: train(f8, compiled=False, check_syncs=True) for f8 in (False, True)}
        same = eager[True] == eager[False]
        failures += not same
        lines.append(f"eager: float8 gather losses {eager[True]} == bf16 gather's: {same}")
        lines.append("no host-device synchronization in Float8Gather.narrow: ok")
    except RuntimeError as err:
        failures += 1
        lines.append(f"FAILED, a synchronization in Float8Gather.narrow or a run error: {err}")
    caught = broken_write_is_caught()
    failures += not caught
    lines.append(f"a list-indexed write fails the synchronization check: {caught}")
    compiled = {f8: train(f8, compiled=True) for f8 in (False, True)}
    lines.append(
        f"compiled (inductor): bf16 gather {compiled[False]}, float8 gather {compiled[True]}"
    )
    if info.rank == 0:
        for line in lines:
            print(line, flush=True)
        print(f"float8 gather nccl: {'ok' if not failures else 'FAILED'}", flush=True)
    dist.destroy_process_group()
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
