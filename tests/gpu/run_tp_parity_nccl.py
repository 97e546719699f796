"""The tensor-parallel parity checks of tests/test_tp_parity.py over NCCL on GPUs.

    torchrun --nproc-per-node 2 tests/gpu/run_tp_parity_nccl.py

Runs every (arch, sequence parallel) case at tp = world size with the model on CUDA in float32
(TF32 off) and prints one line per case with the loss and worst gradient relative errors against
the float64 CPU reference; exits non-zero on any failure. Not collected by pytest (needs GPUs).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_tp_parity import RTOL, parity_body  # noqa: E402

from plait.parallel import init_distributed  # noqa: E402


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    info = init_distributed(backend="nccl")
    failures = 0
    for arch in ("gpt2", "llama", "bert"):
        for sp in (False, True):
            try:
                result = parity_body(arch, info.world_size, sp, device="cuda")
                if info.rank == 0:
                    print(
                        f"nccl tp={info.world_size} {arch:5s} sp={sp!s:5s} loss rel err {result[0]:.2e} "
                        f"worst grad rel err {result[1]:.2e} (tol {RTOL:g}) ok",
                        flush=True,
                    )
            except AssertionError as err:
                failures += 1
                print(
                    f"rank {info.rank} nccl tp={info.world_size} {arch} sp={sp} FAILED: {err}",
                    flush=True,
                )
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
