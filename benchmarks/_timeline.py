"""Where one step's GPU time goes, from a torch.profiler chrome trace: compute, communication, their
overlap and the gaps in which no compute kernel runs on any stream (memory copies are not counted).

    python benchmarks/_timeline.py TRACE.json[.gz] [--gaps 15]      # the summary of a saved trace

``profile_timeline(step, i, path)`` profiles ``step(i)`` and ``step(i + 1)`` (CUDA activity), saves the trace
gzipped at ``path`` (when given) and returns ``summarise(kernels)`` per step, with the host's wall time.
Kernels whose name holds ``nccl`` are communication; every other kernel is compute. Times in ms:

- span: first kernel start to last kernel end;
- compute / comm: the union of the compute / communication kernels' intervals (overlap within a kind once);
- exposed_comm: communication time with no compute kernel running (what overlap did not hide);
- idle: span minus the union of all kernels (host, launch or dependency waits);
- gaps: the longest intervals with no compute kernel, with the compute kernels either side and the
  communication kernels running inside them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os


def load_kernels(path: str) -> list[tuple[float, float, int, str]]:
    """``(start_us, end_us, stream, name)`` of every GPU kernel in a chrome trace, sorted by start."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = [
        (e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream", -1), e["name"])
        for e in events
        if e.get("cat") == "kernel" and "dur" in e
    ]
    return sorted(out)


def _union(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _length(merged) -> float:
    return sum(e - s for s, e in merged)


def _minus(a, b) -> float:
    """Total length of the merged intervals ``a`` not covered by the merged intervals ``b``."""
    out, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        out += max(0.0, e - cur)
    return out


def summarise(kernels, gaps: int = 15) -> dict:
    """The summary of the module docstring from ``load_kernels``'s tuples (ms)."""
    if not kernels:
        return {"span": 0.0, "gaps": []}
    comm = _union((s, e) for s, e, _, n in kernels if "nccl" in n.lower())
    comp = _union((s, e) for s, e, _, n in kernels if "nccl" not in n.lower())
    span = max(e for _, e, _, _ in kernels) - kernels[0][0]
    out = {
        "span": span / 1e3,
        "compute": _length(comp) / 1e3,
        "comm": _length(comm) / 1e3,
        "exposed_comm": _minus(comm, comp) / 1e3,
        "idle": (span - _length(_union(comm + comp))) / 1e3,
    }
    holes = [
        (comp[i + 1][0] - comp[i][1], comp[i][1], comp[i + 1][0]) for i in range(len(comp) - 1)
    ]
    compute = [k for k in kernels if "nccl" not in k[3].lower()]
    rows = []
    for length, s, e in sorted(holes, reverse=True)[:gaps]:
        before = max((k for k in compute if k[1] <= s + 1e-3), key=lambda k: k[1], default=None)
        after = min((k for k in compute if k[0] >= e - 1e-3), key=lambda k: k[0], default=None)
        inside = sorted(
            {k[3][:40] for k in kernels if "nccl" in k[3].lower() and k[0] < e and k[1] > s}
        )
        rows.append(
            {
                "ms": length / 1e3,
                "at_ms": (s - kernels[0][0]) / 1e3,
                "before": before[3][:60] if before else "",
                "after": after[3][:60] if after else "",
                "comm_inside": inside,
            }
        )
    out["gaps"] = rows
    return out


def profile_timeline(step, first: int, path: str | None, steps: int = 2, gaps: int = 15) -> dict:
    """Profile ``step(first)``, ..., ``step(first + steps - 1)`` back to back (CUDA kernels), keep the trace at
    ``path`` (gzipped) and return its summary with every time divided by ``steps`` (per step; the gaps as they
    are) and ``wall``, the host's time per step. With no ``path`` (the other ranks of a collective step) run
    the steps unprofiled and return ``{}``."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    if path is None:
        for i in range(steps):
            step(first + i)
        return {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(first + i)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    raw = path + ".tmp.json"
    prof.export_chrome_trace(raw)
    summary = summarise(load_kernels(raw), gaps)
    with open(raw, "rb") as f, gzip.open(path, "wb") as g:
        g.write(f.read())
    os.remove(raw)
    per_step = {k: v / steps for k, v in summary.items() if k != "gaps"}
    return {**per_step, "wall": wall * 1e3 / steps, "steps": steps, "gaps": summary["gaps"]}


def format_summary(name: str, s: dict) -> str:
    lines = [
        f"== {name}: wall {s.get('wall', 0):.1f} ms, span {s['span']:.1f} ms, compute {s.get('compute', 0):.1f}, "
        f"comm {s.get('comm', 0):.1f}, exposed comm {s.get('exposed_comm', 0):.1f}, idle {s.get('idle', 0):.1f}",
        "| gap ms | at ms | before | after | communication inside |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {g['ms']:.2f} | {g['at_ms']:.1f} | {g['before']} | {g['after']} | {', '.join(g['comm_inside'])} |"
        for g in s.get("gaps", [])
    ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("traces", nargs="+")
    p.add_argument("--gaps", type=int, default=15)
    args = p.parse_args()
    for path in args.traces:
        print(format_summary(os.path.basename(path), summarise(load_kernels(path), args.gaps)))


if __name__ == "__main__":
    main()
