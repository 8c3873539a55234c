"""Loss curves of the runs in result files, raw and as a moving average, in one plot.

    python bench/plot_losses.py OUT.png bench/results/results-cpu-adam-long-*.json

Every curve is a run's per-iteration global loss from its summary.json, as recorded by the bench.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WINDOW = 20  # iterations in the moving average


def moving_average(values: list[float], window: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main(out: str, *files: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for path in files:
        for r in json.loads(Path(path).read_text())["results"]:
            losses = r["summary"].get("losses", [])
            x = range(1, len(losses) + 1)
            (line,) = ax.plot(x, moving_average(losses), label=f"{r['case']['name']} "
                              f"(mean of {WINDOW})")  # fmt: skip
            ax.plot(x, losses, color=line.get_color(), alpha=0.2, lw=0.8)
    ax.set(xlabel="iteration", ylabel="loss", title="loss against iteration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
