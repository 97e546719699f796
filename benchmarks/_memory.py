"""Memory accounting for bench_compile.py: the parts of a training step's peak, and CUDA memory
snapshots with the largest live allocations at the peak.

Parts (bytes): ``params`` (persistent weights in a compute dtype below fp32), ``master`` (persistent
fp32 weights: fp32 model parameters count here, since the optimizer updates them), ``optimizer_state``,
``grads`` (after backward, before the optimizer step: the gradient tensors held, or what the step
holds more than before its forward, whichever is larger: buckets and partitions count there),
``resident`` (allocated between steps), and at the end ``activations`` = peak - params - master -
optimizer_state - grads (activations, workspaces and every other buffer).
"""

from __future__ import annotations

import os
import pickle

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds memory on this rank: a DTensor's local shard, a DeepSpeed ZeRO-3 partition."""
    ds = getattr(t, "ds_tensor", None)
    if ds is not None:
        return ds
    return t.to_local() if hasattr(t, "to_local") else t


def _by_storage(tensors) -> dict[int, torch.Tensor]:
    """One tensor per distinct CUDA storage (views of one flat buffer count once)."""
    out = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = _local(t)
        if t.is_cuda and t.numel():
            out.setdefault(t.untyped_storage().data_ptr(), t)
    return out


def tensor_parts(model_params, optimizers) -> dict[str, int]:
    """``params``/``master``/``optimizer_state``/``grads`` of torch-style training: the model's parameters
    and the optimizers' parameters (DeepSpeed's fp32 partitions), split by dtype; the optimizers' state
    tensors; the ``.grad`` of all of them."""
    model_params = list(model_params)
    weights = model_params + [p for o in optimizers for g in o.param_groups for p in g["params"]]
    parts = {"params": 0, "master": 0}
    for t in _by_storage(weights).values():
        parts["master" if t.dtype == torch.float32 else "params"] += t.untyped_storage().nbytes()
    state = [v for o in optimizers for st in o.state.values() for v in st.values()]
    parts["optimizer_state"] = _nbytes(state)
    parts["grads"] = _nbytes(p.grad for p in weights)
    return parts


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in _by_storage(tensors).values())


def plait_parts(engine) -> dict[str, int]:
    """``ZeroOptimizer.memory_bytes()`` of plait's engine (params, grads, grad_shards, master, optimizer_state)."""
    return dict(engine.optimizer.memory_bytes())


class Probe:
    """Called between backward and the optimizer step: memory allocated then."""

    def __init__(self, extra=None):
        self.extra, self.allocated, self.detail = extra, None, None

    def __call__(self):
        torch.cuda.synchronize()
        self.allocated = torch.cuda.memory_allocated()
        if self.extra is not None:
            self.detail = self.extra()


def measure_parts(step, i: int, parts_fn, peak: int) -> dict:
    """One more step with a probe after backward; the parts of ``peak`` (see the module docstring)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    probe = Probe(parts_fn)
    step(i, probe)
    torch.cuda.synchronize()
    after = parts_fn()
    out = {k: after.get(k, 0) for k in ("params", "master", "optimizer_state")}
    held = probe.detail or {}
    out["grads"] = max(
        (probe.allocated or before) - before, held.get("grads", 0) + held.get("grad_shards", 0)
    )
    out["resident"] = torch.cuda.memory_allocated()
    out["activations"] = peak - sum(
        out[k] for k in ("params", "master", "optimizer_state", "grads")
    )
    out["detail_after_backward"], out["detail_after_step"] = probe.detail, after
    return out


# ---- snapshots -------------------------------------------------------------------------------------
def start_recording():
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")


def dump_recording(path: str):
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


_OWN = ("/plait/", "/benchmarks/", "/torchtitan/", "/deepspeed/")


def _where(frames) -> str:
    """The innermost frame of plait/the benchmark/torchtitan/DeepSpeed, and the innermost torch frame."""
    frames = [f for f in frames or [] if f.get("filename", "??") != "??"]
    own = next((f for f in frames if any(k in f["filename"] for k in _OWN)), None)
    lib = next((f for f in frames if "/torch/" in f["filename"]), None)
    fmt = lambda f: f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}"  # noqa: E731
    text = " <- ".join(fmt(f) for f in (lib, own) if f is not None)
    return text or "(allocated before recording, or no Python frame)"


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, list[tuple[int, list]]]:
    """Replays the allocator trace backwards from the live blocks at dump time; returns the peak total
    of live bytes and the ``(size, allocation frames)`` of each block live then."""
    trace = snapshot["device_traces"][device]
    alloc_frames, last = {}, {}  # free event index -> frames of the allocation it frees
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            last[ev["addr"]] = ev.get("frames", [])
        elif ev["action"] == "free_completed":
            alloc_frames[i] = last.pop(ev["addr"], [])
    live = {
        b["address"]: (b["size"], b["frames"])
        for seg in snapshot["segments"]
        if seg.get("device", 0) == device
        for b in _blocks(seg)
    }
    total = sum(size for size, _ in live.values())
    best, best_set = total, dict(live)
    for i in range(len(trace) - 1, -1, -1):
        ev = trace[i]
        if ev["action"] == "alloc" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
        elif ev["action"] == "free_completed" and ev["addr"] not in live:
            live[ev["addr"]] = (ev["size"], alloc_frames.get(i, []))
            total += ev["size"]
            if total > best:
                best, best_set = total, dict(live)
    return best, sorted(best_set.values(), key=lambda x: -x[0])


def _blocks(seg):
    addr = seg["address"]
    for b in seg["blocks"]:
        if b["state"] in ("active_allocated", "active_pending_free"):
            yield {"address": addr, "size": b["size"], "frames": b.get("frames", [])}
        addr += b["size"]


def top_allocations(path: str, n: int = 20) -> str:
    """The ``n`` largest allocations live at the peak of a ``_dump_snapshot`` pickle, with where each came from."""
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    peak, blocks = live_at_peak(snapshot)
    lines = [
        f"{path}: peak of live allocations {peak / 2**30:.2f} GiB in {len(blocks)} blocks; top {n}:",
        "| MiB | where (innermost torch frame <- innermost plait/benchmark frame) |",
        "|---|---|",
    ]
    lines += [f"| {size / 2**20:.1f} | {_where(frames)} |" for size, frames in blocks[:n]]
    sites: dict[str, list[int]] = {}
    for size, frames in blocks:
        site = sites.setdefault(_where(frames), [0, 0])
        site[0] += size
        site[1] += 1
    lines += [
        "",
        f"Live at the peak by allocation site (top {n}):",
        "| MiB | blocks | where |",
        "|---|---|---|",
    ]
    lines += [
        f"| {total / 2**20:.1f} | {count} | {where} |"
        for where, (total, count) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:n]
    ]
    return "\n".join(lines)


def snapshot_step(arm, step, i, folder) -> dict:
    """Run step ``i`` while recording (``start_recording`` was called before the model was built); write the
    pickle and its top allocations to ``folder``."""
    os.makedirs(folder, exist_ok=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(i)
    torch.cuda.synchronize()
    path = os.path.join(folder, f"{arm}.pickle")
    dump_recording(path)
    top = top_allocations(path)
    with open(os.path.join(folder, f"{arm}.top20.md"), "w") as f:
        f.write(top + "\n")
    print(top, flush=True)
    return {
        "arm": arm,
        "snapshot": path,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
