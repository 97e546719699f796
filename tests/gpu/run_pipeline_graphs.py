"""CUDA-graphed pipeline actions against the eager executor, on 1 or 2 GPUs:

    torchrun --nproc-per-node 1 tests/gpu/run_pipeline_graphs.py     # p = 1: every hand-over local
    torchrun --nproc-per-node 2 tests/gpu/run_pipeline_graphs.py     # p = 2: activations over NCCL

A float32 Llama of 4 blocks (hidden 256, GQA), the same seeded weights and micro-batches for both arms,
``PipelineParallel(..., cuda_graphs=True)`` against ``cuda_graphs=False`` for 1F1B, interleaved (v=2), ZB-H1
and ZB-V, m = 4: three steps each, with an AdamW step in between (the graphs read the parameters in place),
comparing every step's loss and, after the last step, every parameter's gradient and value.

Tolerance: the graphs replay the eager executor's kernels on the same operands, so the results agree to the
last bit unless cuBLAS picks another algorithm under capture; 1e-6 of each tensor's largest magnitude covers
a different float32 summation order (about 2^-24 x sqrt(k) relative for k-term dot products, k <= 1024 here,
3.8e-6 worst case, 1e-7 typical) while a stale input or a missed accumulation is off by O(1).
The negative control replays F without copying the micro-batch into the slot (every micro-batch then trains
on the capture's tokens) and must fail the same check. Rank 0 prints one line per check; exit 1 on a failure.
Also checks: a second capture only when shapes change; through ``engine.train_batch`` (float32, AdamW,
clipping 1.0), ZeRO-1 and ZeRO-2 graphed against eager with the same tolerance, and ZeRO-3 refused.
Not collected by pytest (needs GPUs).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from plait.models import preset
from plait.layers.stages import build_stage_modules  # noqa: E402
from plait.parallel import ParallelMesh, init_distributed  # noqa: E402
from plait.parallel.pipeline.parallel import PipelineParallel  # noqa: E402
import plait.parallel.pipeline.graphs as pipeline_graphs  # noqa: E402

M, MBS, SEQ, STEPS = 4, 2, 128, 3
CFG = dict(
    vocab_size=512,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden_size=688,
    max_position_embeddings=SEQ,
)


def batches(step: int, device, seq: int = SEQ) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(100 + step)
    ids = torch.randint(0, CFG["vocab_size"], (M, MBS, seq + 1), device=device, generator=g)
    return [{"input_ids": ids[i, :, :-1], "labels": ids[i, :, 1:]} for i in range(M)]


def train(mesh, schedule: str, graphs: bool, seq: int = SEQ):
    """Losses of each step, the final gradients and parameters (by name), and the pipeline."""
    v = 2 if schedule in ("interleaved", "zb-v") else 1
    chunks = build_stage_modules(
        preset("llama-886m", **CFG),
        mesh,
        v=v,
        seed=0,
        device=mesh.device,
        dtype=torch.float32,
        schedule=schedule,
    )
    pipe = PipelineParallel(chunks, mesh, schedule=schedule, micro_batches=M, cuda_graphs=graphs)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-3)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.train_batch(iter(batches(step, mesh.device, seq))).item())
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        if step < STEPS - 1:
            opt.step()
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return losses, grads, params, pipe


def worst(a: dict, b: dict) -> float:
    """Largest |a - b| over all tensors, each relative to its largest |a|."""
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)).item() for k in a)


def check(name: str, ok: bool, detail: str, failures: list) -> None:
    if dist.get_rank() == 0:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def compare(mesh, schedule: str, failures: list, expect_equal: bool = True) -> None:
    ref = train(mesh, schedule, graphs=False)
    got = train(mesh, schedule, graphs=True)
    loss_err = max(abs(a - b) / abs(a) for a, b in zip(ref[0], got[0]))
    err = max(loss_err, worst(ref[1], got[1]), worst(ref[2], got[2]))
    errs = torch.tensor([err], device=mesh.device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    ok = (errs.item() <= 1e-6) == expect_equal
    what = "graphs = eager" if expect_equal else "negative control differs"
    check(
        f"{schedule} p={mesh.pp}",
        ok,
        f"{what}: worst relative difference {errs.item():.2e} (losses {got[0]})",
        failures,
    )


def engine_losses(mesh, stage: int, graphs: bool):
    """Losses of STEPS ``engine.train_batch`` calls (1F1B, float32, ZeRO ``stage``, AdamW, clipping 1.0) and
    the final parameters."""
    import plait

    chunks = build_stage_modules(
        preset("llama-886m", **CFG), mesh, v=1, seed=0, device=mesh.device, dtype=torch.float32
    )
    pipe = PipelineParallel(chunks, mesh, schedule="1f1b", micro_batches=M, cuda_graphs=graphs)
    config = {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": M,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "pipeline": {"size": mesh.pp, "schedule": "1f1b"},
    }
    engine = plait.initialize(pipe, config, mesh=mesh)
    losses = [engine.train_batch(iter(batches(step, mesh.device))).item() for step in range(STEPS)]
    return losses, {n: p.detach().clone() for n, p in pipe.named_parameters()}


def engine_checks(mesh, failures: list) -> None:
    """Through the engine: ZeRO-1 and ZeRO-2 (their post-accumulate hooks run after each replay) as eager;
    ZeRO-3 refused at the first step with the reason."""
    for stage in (1, 2):
        ref, got = engine_losses(mesh, stage, False), engine_losses(mesh, stage, True)
        err = max(max(abs(a - b) / abs(a) for a, b in zip(ref[0], got[0])), worst(ref[1], got[1]))
        errs = torch.tensor([err], device=mesh.device)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        check(
            f"engine ZeRO-{stage} p={mesh.pp}",
            errs.item() <= 1e-6,
            f"graphs = eager: worst relative difference {errs.item():.2e} (losses {got[0]})",
            failures,
        )
    try:
        engine_losses(mesh, 3, True)
        message = "no error"
    except ValueError as e:
        message = str(e)
    check(
        "engine ZeRO-3 refused", "ZeRO-3" in message and "hooks" in message, message[:160], failures
    )


def recapture(mesh, failures: list) -> None:
    """A step of new shapes captures again; the same shapes do not."""
    _, _, _, pipe = train(mesh, "1f1b", graphs=True)
    before = pipe.executor.graphs.captures
    pipe.train_batch(iter(batches(9, mesh.device, SEQ // 2)))
    pipe.train_batch(iter(batches(10, mesh.device, SEQ // 2)))
    after = pipe.executor.graphs.captures
    check(
        "recapture",
        before == 1 and after == 2,
        f"captures after {STEPS} steps {before}, after two steps of a new sequence length {after}",
        failures,
    )


def main() -> int:
    info = init_distributed()
    mesh = ParallelMesh(tp=1, pp=info.world_size)
    failures: list = []
    for schedule in ("1f1b", "interleaved", "zb-h1", "zb-v"):
        compare(mesh, schedule, failures)
    recapture(mesh, failures)
    engine_checks(mesh, failures)
    copy_batch = pipeline_graphs.ActionGraphs.forward

    def stale_forward(
        self, chunk, mb, x, batch
    ):  # broken on purpose: the slot keeps the capture's tokens
        return copy_batch(self, chunk, mb, x, {})

    pipeline_graphs.ActionGraphs.forward = stale_forward
    compare(mesh, "1f1b", failures, expect_equal=False)
    pipeline_graphs.ActionGraphs.forward = copy_batch
    if info.rank == 0:
        print("FAILED: " + ", ".join(failures) if failures else "all checks passed", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
