"""Summarize a profiling.use_pytorch_profiler trace: GPU busy vs idle, kernels and runtime calls.

    python bench/profile_summary.py RUN_DIR/profile/rank0.json.gz [...]

Prints, per trace: the window's wall span, the union of kernel time (GPU busy), the idle rest,
the kernels and CUDA runtime calls that take the most time, and the Python-side ops by self time;
then each micro-batch (from one forward's embedding lookup to the next, the last to the window's
end): its host span and the GPU's busy time in it, so a slowdown shows where it sits in the step.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def summarize(path: str, top: int = 12) -> str:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in timed if e.get("cat") == "kernel"]
    copies = [e for e in timed if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    runtime = [e for e in timed if e.get("cat") == "cuda_runtime"]
    ops = [e for e in timed if e.get("cat") == "cpu_op"]
    start = min(e["ts"] for e in timed)
    end = max(e["ts"] + e["dur"] for e in timed)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    lines = [f"== {path}", f"window {(end - start) / 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms "
             f"({busy / (end - start):.0%}), {len(kernels)} kernels, copies "
             f"{sum(e['dur'] for e in copies) / 1e3:.1f} ms"]  # fmt: skip
    for title, group in (("kernels", kernels), ("cuda runtime", runtime), ("cpu ops", ops)):
        total: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for e in group:
            total[e["name"][:90]] += e["dur"]
            count[e["name"][:90]] += 1
        lines.append(f"-- {title} by total ms")
        lines += [f"{t / 1e3:10.2f} {count[n]:6d}  {n}" for n, t in total.most_common(top)]
    lines += _micro_batches(ops, kernels, end)
    return "\n".join(lines)


def _micro_batches(ops: list, kernels: list, end: float) -> list[str]:
    """Per micro-batch (a forward's ``aten::embedding`` to the next): host ms, GPU busy ms."""
    starts = sorted(e["ts"] for e in ops if e["name"] == "aten::embedding")
    if not starts:
        return []
    spans = list(zip(starts, [*starts[1:], end], strict=True))
    lines = ["-- micro-batches: host ms / GPU busy ms (forward start to the next; the last to "
             "the window's end)"]  # fmt: skip
    for i, (a, b) in enumerate(spans):
        busy = _union([(max(k["ts"], a), min(k["ts"] + k["dur"], b)) for k in kernels
                       if k["ts"] < b and k["ts"] + k["dur"] > a])  # fmt: skip
        lines.append(f"{i:3d} {(b - a) / 1e3:9.1f} {busy / 1e3:9.1f}")
    return lines


if __name__ == "__main__":
    print("\n\n".join(summarize(p) for p in sys.argv[1:]))
