"""The CPU-offload fraction sweep as a plot: slowdown against this suite's baseline and peak GPU
memory, per engine (HybridDeviceOptimizer + overlap, cpu_adam, cpu_adam_delayed), at GBS 4.

    python bench/plot_cpu_adam_sweep.py OUT.png bench/results/results-cpu-adam-4.json \\
        bench/results/results-cpu-adam-sweep-*.json

Each point is a real run from the given result files, set against the no-offload baseline of its
own suite (one line per engine and suite: the baselines of two suites differ, see BENCHMARKS).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ENGINES = {"HDO": "HybridDeviceOptimizer + overlap", "cpu_adam": "cpu_adam (exact)",
           "cpu_adam_delayed": "cpu_adam_delayed"}  # fmt: skip
NAME = re.compile(r"(?:sweep |GBS4 )(HDO|cpu_adam_delayed|cpu_adam) (\d+)%")


def points(files: list[Path]) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """(engine, suite) -> [(fraction, slowdown, peak GB)], sorted by fraction."""
    found: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for path in files:
        suite = json.loads(path.read_text())["suite"]
        results = json.loads(path.read_text())["results"]
        base = {r["case"]["name"]: r["summary"] for r in results}
        for r in results:
            match = NAME.fullmatch(r["case"]["name"].replace(" + overlap", ""))
            s = r["summary"]
            if not match or r["status"] != "ok" or "GBS1" in r["case"]["name"]:
                continue
            b = base[r["case"]["baseline"]]
            found.setdefault((match[1], suite), []).append((int(match[2]) / 100,
                                    s["step_time_s_median"] / b["step_time_s_median"],
                                    s["gpu_peak_allocated_gb"]))  # fmt: skip
    return {key: sorted(v) for key, v in sorted(found.items())}


def main(out: str, *files: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = points([Path(f) for f in files])
    fig, (slow, peak) = plt.subplots(1, 2, figsize=(10, 4))
    colors = dict(zip(ENGINES, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    markers = {}
    for (engine, suite), pts in data.items():
        marker = markers.setdefault(suite, "os^v"[len(markers) % 4])
        x = [p[0] for p in pts]
        label = f"{ENGINES[engine]} ({suite})"
        slow.plot(x, [p[1] for p in pts], marker + "-", color=colors[engine], label=label)
        peak.plot(x, [p[2] for p in pts], marker + "--", color=colors[engine], label=label)
    slow.axhline(1.0, color="gray", lw=0.8)
    slow.set(xlabel="optimizer_offload_fraction", ylabel="step time / no-offload step",
             title="slowdown (GBS 4, one H200)", ylim=(0, None))  # fmt: skip
    peak.set(xlabel="optimizer_offload_fraction", ylabel="peak GPU memory (GiB)",
             title="peak GPU memory", ylim=(0, None))  # fmt: skip
    slow.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
