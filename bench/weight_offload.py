#!/usr/bin/env python
"""Weight offload: each run beside the same run with its weights on the GPU (or, under a GPU
memory cap, beside the capped run without weight offload, which ran out of memory), against
the link's bound for what it moves.

    python bench/weight_offload.py bench/results/results-weight-offload*.json \\
        --plot docs/benchmarks/weight-offload.png > docs/benchmarks/weight-offload.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from plots import commands_block, pyplot, report_main, save  # noqa: E402
from suite_report import _weight_offload_lines  # noqa: E402

from offload_runner.report import markdown_table  # noqa: E402

HEADER = (
    "row",
    "baseline",
    "GPU",
    "status",
    "step s",
    "forward+backward s",
    "GPU peak GB",
    "step vs baseline",
    "peak vs baseline",
)


def load(files: list[Path]) -> list[dict]:
    """Every run of the files, with its call's environment and suite."""
    return [
        {**r, "environment": d["environment"], "suite": d["suite"]}
        for path in sorted(files)
        for d in [json.loads(path.read_text())]
        for r in d["results"]
    ]


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(results: list[dict]) -> list[list[str]]:
    by_name = {r["case"]["name"]: r for r in results}
    out = []
    for r in results:
        s = r["summary"] or {}
        base = by_name.get(r["case"]["baseline"], {}).get("summary") or {}
        is_base = r["case"]["baseline"] == r["case"]["name"]
        out.append(
            [
                f"{r['case']['name']} (`{r['suite']}`)",
                "" if is_base else r["case"]["baseline"],
                r["environment"]["gpu"].replace("NVIDIA ", ""),
                r["status"],
                f"{s['step_time_s_median']:.3f}" if s else "-",
                f"{s['fwd_bwd_time_s_median']:.3f}" if s else "-",
                f"{s['gpu_peak_allocated_gb']:.1f}" if s else "-",
                ""
                if is_base
                else _ratio(s.get("step_time_s_median"), base.get("step_time_s_median")),
                ""
                if is_base
                else _ratio(s.get("gpu_peak_allocated_gb"), base.get("gpu_peak_allocated_gb")),
            ]
        )
    return out


def render(files: list[Path], plot: Path | None) -> str:
    results = load(files)
    by_name = {r["case"]["name"]: r for r in results}
    envs = {(r["environment"]["gpu"], r["environment"]["megatron.core"]) for r in results}
    lines = [
        "# Weight offload",
        "",
        "`offload/weight=enabled model.cpu_offloading_num_layers=N` (beside state offload): the "
        "first N layers' weights, gradients, masters and moments on the host, their modules' "
        "weights streamed through a GPU ring for forward and backward. "
        + "; ".join(f"{gpu}, megatron-core {mcore}" for gpu, mcore in sorted(envs))
        + f"; {', '.join(sorted(f.name for f in files))}.",
        "",
        *markdown_table(HEADER, table(results)),
        *_weight_offload_lines(results, by_name),
        "",
    ]
    if plot is not None:
        draw(results, plot)
        lines += [f"![GPU peak and step beside the baseline]({plot.name})", ""]
    commands = {r["case"]["name"]: " ".join(r["command"]) for r in results}
    return "\n".join([*lines, commands_block(commands)])


def draw(results: list[dict], out: Path) -> None:
    """Each weight-offload run's GPU peak and step beside its baseline's."""
    plt = pyplot()
    by_name = {r["case"]["name"]: r for r in results}
    pairs = [
        (r, by_name[r["case"]["baseline"]])
        for r in results
        if r["status"] == "ok"
        and r["case"]["baseline"] != r["case"]["name"]
        and r["case"]["baseline"] in by_name
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.6 * len(pairs) + 1.6), sharey=True)
    y = list(range(len(pairs)))
    for ax, key, what in (
        (axes[0], "gpu_peak_allocated_gb", "GPU peak GB"),
        (axes[1], "step_time_s_median", "step s"),
    ):
        base = [(b["summary"] or {}).get(key, 0) for _, b in pairs]  # 0: it ran out of memory
        ax.barh([i - 0.2 for i in y], base, height=0.4, label="baseline (0: out of memory)")
        ours = [r["summary"][key] for r, _ in pairs]
        ax.barh([i + 0.2 for i in y], ours, height=0.4, label="with weight offload")
        ax.set(xlabel=what)
    axes[0].set_yticks(y, [r["case"]["name"] for r, _ in pairs], fontsize=7)
    axes[0].legend(fontsize=7)
    save(fig, out)


if __name__ == "__main__":
    sys.exit(report_main(__doc__, render))
