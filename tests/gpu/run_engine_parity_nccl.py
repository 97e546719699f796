"""The engine's ZeRO 0-3 parity check of tests/test_engine.py over NCCL on GPUs.

    torchrun --nproc-per-node 2 tests/gpu/run_engine_parity_nccl.py [--tp 1|2]

Model on CUDA in float32 (TF32 off); rank 0 compares every whole weight after 5 steps and the loss
curve with the single-process CPU AdamW reference (1e-6 / 1e-5 relative) and prints one line.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_engine import check_engine_results, engine_body, reference  # noqa: E402

from plait.parallel import init_distributed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    info = init_distributed(backend="nccl")
    results = engine_body(args.tp, device="cuda")
    status = 0
    if info.rank == 0:
        dp = info.world_size // args.tp
        ref_weights, ref_losses = reference(dp)
        try:
            check_engine_results(results, ref_weights, ref_losses, args.tp, dp)
            print(
                f"nccl engine parity tp={args.tp} dp={dp}: ZeRO stages 0-3 match the reference "
                f"(weights 1e-6, losses 1e-5) ok",
                flush=True,
            )
        except AssertionError as err:
            print(f"nccl engine parity tp={args.tp} dp={dp} FAILED: {err}", flush=True)
            status = 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
