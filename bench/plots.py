"""Plots for docs/BENCHMARKS.md from bench result files (every point a real run).

    python bench/plots.py sweep OUT.png bench/results/results-cpu-adam-4.json \\
        bench/results/results-cpu-adam-sweep.json
    python bench/plots.py losses OUT.png bench/results/results-cpu-adam-long-*.json
    python bench/plots.py losses OUT.png bench/results/results-cpu-adam-conv-*.json \\
        docs/evidence/cpu-adam-conv-predicting-seed*.jsonl

``sweep``: the CPU-offload fraction sweep, slowdown against each suite's own no-offload run and
peak GPU memory, one line per engine (HybridDeviceOptimizer + overlap, cpu_adam,
cpu_adam_delayed) and suite (the baselines of two suites differ, see BENCHMARKS).
``losses``: each run's per-iteration global loss, raw and as a moving average (from result files,
or a run's metrics.jsonl).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: str | Path, dpi: int = 110) -> None:
    """Lay ``fig`` out, write it to ``out`` and free it."""
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    pyplot().close(fig)


def commands_block(commands: dict[str, str]) -> str:
    """A report's last lines: each run's command line, folded."""
    lines = [f"- {name}: `{command}`" for name, command in commands.items()]
    return "\n".join(["<details><summary>commands</summary>", "", *lines, "", "</details>", ""])


def report_main(doc: str, render) -> int:
    """A topic report's command line: result files in, its Markdown on stdout, ``--plot`` the
    PNG beside it (``render(files, plot)``)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path, default=None, help="the PNG to write")
    args = parser.parse_args()
    print(render(args.files, args.plot))
    return 0


def _save(fig, out: str) -> None:
    save(fig, out, dpi=120)
    print(f"wrote {out}")


ENGINES = {
    "HDO": "HybridDeviceOptimizer + overlap",
    "cpu_adam": "cpu_adam (exact)",
    "cpu_adam_delayed": "cpu_adam_delayed",
}
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
            found.setdefault((match[1], suite), []).append(
                (
                    int(match[2]) / 100,
                    s["step_time_s_median"] / b["step_time_s_median"],
                    s["gpu_peak_allocated_gb"],
                )
            )
    return {key: sorted(v) for key, v in sorted(found.items())}


def sweep(out: str, *files: str) -> None:
    plt = pyplot()
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
    slow.set(
        xlabel="optimizer_offload_fraction",
        ylabel="step time / no-offload step",
        title="slowdown (GBS 4, one H200)",
        ylim=(0, None),
    )
    peak.set(
        xlabel="optimizer_offload_fraction",
        ylabel="peak GPU memory (GiB)",
        title="peak GPU memory",
        ylim=(0, None),
    )
    slow.legend(fontsize=7)
    _save(fig, out)


WINDOW = 20  # iterations in the moving average


def moving_average(values: list[float], window: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def curves(path: Path) -> list[tuple[str, list[float]]]:
    """(name, per-iteration losses) of a bench result file's runs, or of one run's metrics.jsonl
    (named after the file; a run stopped early has fewer iterations)."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        steps = [r["loss"] for r in rows if "loss" in r]  # not the validation lines
        return [(f"{path.stem} ({len(steps)} iterations)", steps)]
    return [
        (r["case"]["name"], r["summary"].get("losses", []))
        for r in json.loads(path.read_text())["results"]
    ]


def losses(out: str, *files: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    every = [(name, values) for path in files for name, values in curves(Path(path))]
    for name, values in every:
        x = range(1, len(values) + 1)
        (line,) = ax.plot(x, moving_average(values), label=f"{name} (mean of {WINDOW})")
        ax.plot(x, values, color=line.get_color(), alpha=0.2, lw=0.8)
    low = min((min(v) for _, v in every if v), default=1.0)
    if low > 0 and max(max(v) for _, v in every if v) / low > 100:
        ax.set_yscale("log")  # losses that fall to near zero
    ax.set(xlabel="iteration", ylabel="loss", title="loss against iteration")
    ax.legend(fontsize=7)
    _save(fig, out)


PLOTS = {"sweep": sweep, "losses": losses}

if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] not in PLOTS:
        sys.exit(f"usage: python bench/plots.py {{{'|'.join(PLOTS)}}} OUT.png RESULTS.json ...")
    PLOTS[sys.argv[1]](*sys.argv[2:])
