"""ZeRO-Offload on a GPU: the CPU/gloo parity cases of tests/test_offload.py, plus the pinned buffers.

    python tests/gpu/run_offload_gpu.py                        # one GPU
    torchrun --nproc-per-node 2 tests/gpu/run_offload_gpu.py   # dp = 2 over NCCL

Checks, printed one line each (exit status 1 on any failure):
* ``plait.zero.pinned.host_empty`` pins exactly the bytes asked for: a 1.25 GiB buffer is page-locked
  (``is_pinned``) and grows the resident set by 1.25 GiB +- 5%, not by the 2 GiB that torch's
  power-of-two caching host allocator would take; asynchronous copies through it round-trip.
* ``adam_update_`` (the device share's update) equals the numba CPU kernel bit for bit on CUDA.
* ``device_step_fraction`` left out: the adaptive device share, bit-identical to the all-host step.
* Every case of ``tests/offload_helpers.CASES`` (stages 1-3, offload_param, early and deferred host steps,
  bf16 with bf16 host gradients) on CUDA (TF32 off): after 5 steps every whole weight equals the
  non-offloaded run to 1e-6 relative (bf16 cases: 1e-4, fp32 masters 1e-6; device-step cases 1e-5, see
  tests/test_offload.py), losses to 1e-6; with ``offload_optimizer.ratio`` < 1 each resident group's
  master and Adam moments are in device memory and every other group's in host memory.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import rel_err
from offload_helpers import CASES, STEPS, ds_config, train

from plait.parallel import init_distributed
from plait.zero.pinned import host_empty


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def check_pinned() -> str:
    numel = 5 * 2**27  # bf16: 1.25 GiB (the caching allocator would round it to 2 GiB)
    before = rss_bytes()
    t = host_empty(numel, torch.bfloat16, pin=True)
    grew = rss_bytes() - before
    want = numel * 2
    assert t.is_pinned(), "host_empty(pin=True) returned pageable memory"
    assert abs(grew - want) <= 0.05 * want, (
        f"resident set grew {grew / 2**30:.2f} GiB for {want / 2**30:.2f} GiB"
    )
    src = torch.arange(numel, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    t.copy_(src, non_blocking=True)
    back = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    return f"pinned: {want / 2**30:.2f} GiB buffer page-locked, resident set +{grew / 2**30:.2f} GiB, round trip exact"


def check_device_update() -> str:
    """``adam_update_`` on CUDA is bit-identical to the numba CPU kernel (IEEE sqrt and division on CUDA)."""
    from plait.kernels import CPUAdam
    from plait.zero.offload.device_share import adam_update_

    g0 = torch.Generator().manual_seed(0)
    n, bad = 1 << 20, 0
    for adamw in (True, False):
        p = torch.randn(n, generator=g0)
        g = (torch.randn(n, generator=g0) * 1e-2).to(torch.bfloat16)
        k = CPUAdam(n, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adamw_mode=adamw)
        k.exp_avg.copy_(torch.randn(n, generator=g0) * 1e-3)
        k.exp_avg_sq.copy_(torch.rand(n, generator=g0) * 1e-5)
        m0, v0 = k.exp_avg.clone(), k.exp_avg_sq.clone()
        k.step_count = 2
        k.begin_step()
        w_cpu = p.clone()
        k.step_range(w_cpu, g, 0, n, grad_coef=0.4813)
        w, m, v = p.cuda(), m0.cuda(), v0.cuda()
        adam_update_(w, g.cuda(), m, v, k, 0.4813)
        bad += (
            int((w.cpu() != w_cpu).sum())
            + int((m.cpu() != k.exp_avg).sum())
            + int((v.cpu() != k.exp_avg_sq).sum())
        )
    assert bad == 0, f"{bad} elements differ between the CUDA update and the CPU kernel"
    return (
        "device update: bit-identical to the CPU kernel on CUDA (Adam and AdamW, 2^20 elements) ok"
    )


def check_default_share() -> str:
    """Collective. ``device_step_fraction`` left out on CUDA: the adaptive device share, bit-identical to the
    all-host step (``device_step_fraction: 0``)."""
    host = train(ds_config(2, offload=True, gas=1), STEPS, device="cuda")
    auto = train(ds_config(2, offload=True, gas=1, device_step=None), STEPS, device="cuda")
    bad = sum(int((auto["masters"][k].cpu() != m.cpu()).sum()) for k, m in host["masters"].items())
    ok = bad == 0 and auto["split_history"] and max(auto["split_history"]) > 0
    return (
        f"default device share on CUDA: segments on the device per step {auto['split_history']}, "
        f"{bad} master elements differ from the all-host step {'ok' if ok else 'FAILED'}"
    )


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    info = init_distributed(backend="nccl")
    failures = 0
    lines = []
    if info.rank == 0:
        for check in (check_pinned, check_device_update):
            try:
                lines.append(check())
            except AssertionError as err:
                lines.append(f"{check.__name__} FAILED: {err}")
                failures += 1
    for case, (ref_cfg, off_cfg) in CASES.items():
        ref, got = train(ref_cfg, STEPS, device="cuda"), train(off_cfg, STEPS, device="cuda")
        if info.rank != 0:
            continue
        stepped_on_device = "device step" in case or "ratio" in case
        tol = (
            1e-4 if case.startswith("bf16") else 1e-5 if stepped_on_device else 1e-6
        )  # as test_offload
        mtol = 1e-5 if stepped_on_device else 1e-6
        w_err = max(
            rel_err(got["weights"][n].cpu(), w.cpu(), floor=1e-12)
            for n, w in ref["weights"].items()
        )
        m_err = max(
            rel_err(got["masters"][k].cpu(), m.cpu(), floor=1e-12)
            for k, m in ref["masters"].items()
        )
        l_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        # the placement: a resident group's master and moments in device memory, every other group's on the host
        misplaced = (
            [p for p in got["placed"] if p[2:] != (("cuda", "cuda") if p[0] else ("cpu", "cpu"))]
            if "offload_optimizer" in off_cfg["zero_optimization"]
            else []
        )
        resident = sum(n for on_device, n, *_ in got["placed"] if on_device) / sum(
            n for _, n, *_ in got["placed"]
        )
        ok = (
            w_err <= tol
            and m_err <= mtol
            and l_err <= 1e-6
            and got["steps"] == STEPS
            and not misplaced
        )
        failures += not ok
        lines.append(
            f"{case} dp={info.world_size}: weights {w_err:.1e} (tol {tol:.0e}), masters {m_err:.1e}, "
            f"losses {l_err:.1e}, host grads {got['grad_dtype']}, states on the GPU {resident:.0%}"
            f"{', misplaced ' + str(misplaced) if misplaced else ''} {'ok' if ok else 'FAILED'}"
        )
    lines.append(check_default_share())
    failures += "FAILED" in lines[-1]
    if info.rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
