"""The CPU-offload fraction sweep as a plot: slowdown against this suite's baseline and peak GPU
memory, per engine (HybridDeviceOptimizer + overlap, cpu_adam, cpu_adam_delayed), at GBS 4.

    python bench/plot_cpu_adam_sweep.py OUT.png bench/results/results-cpu-adam-4.json \\
        bench/results/results-cpu-adam-sweep-*.json

Each point is a real run from the given result files, set against the no-offload baseline of its
own file (100% comes from the cpu-adam-4 suite, the other fractions from the sweep suites).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ENGINES = {"HDO": "HybridDeviceOptimizer + overlap", "cpu_adam": "cpu_adam (exact)",
           "cpu_adam_delayed": "cpu_adam_delayed"}  # fmt: skip
NAME = re.compile(r"(?:sweep |GBS4 )(HDO|cpu_adam_delayed|cpu_adam) (\d+)%")


def points(files: list[Path]) -> dict[str, list[tuple[float, float, float]]]:
    """engine -> [(fraction, slowdown, peak GB)], sorted by fraction."""
    found: dict[str, list[tuple[float, float, float]]] = {e: [] for e in ENGINES}
    for path in files:
        results = json.loads(path.read_text())["results"]
        base = {r["case"]["name"]: r["summary"] for r in results}
        for r in results:
            match = NAME.fullmatch(r["case"]["name"].replace(" + overlap", ""))
            s = r["summary"]
            if not match or r["status"] != "ok" or "GBS1" in r["case"]["name"]:
                continue
            b = base[r["case"]["baseline"]]
            found[match[1]].append((int(match[2]) / 100,
                                    s["step_time_s_median"] / b["step_time_s_median"],
                                    s["gpu_peak_allocated_gb"]))  # fmt: skip
    return {e: sorted(v) for e, v in found.items() if v}


def main(out: str, *files: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = points([Path(f) for f in files])
    fig, (slow, peak) = plt.subplots(1, 2, figsize=(10, 4))
    for engine, pts in data.items():
        x = [p[0] for p in pts]
        slow.plot(x, [p[1] for p in pts], "o-", label=ENGINES[engine])
        peak.plot(x, [p[2] for p in pts], "s--", label=ENGINES[engine])
    slow.axhline(1.0, color="gray", lw=0.8)
    slow.set(xlabel="optimizer_offload_fraction", ylabel="step time / no-offload step",
             title="slowdown (GBS 4, one H200)", ylim=(0, None))  # fmt: skip
    peak.set(xlabel="optimizer_offload_fraction", ylabel="peak GPU memory (GiB)",
             title="peak GPU memory", ylim=(0, None))  # fmt: skip
    slow.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
