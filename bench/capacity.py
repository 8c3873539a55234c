#!/usr/bin/env python
"""What fits: the largest runs of Qwen3-30B-A3B on one and two H200, each beside the same line
without offload and against what `--plan` promised (auto's own line of the run).

    python bench/capacity.py bench/results/results-{capacity-*,whole-model,two-gpu-full-*}.json \\
        --plot docs/benchmarks/capacity.png > docs/benchmarks/capacity.md
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from plots import commands_block, pyplot, report_main, save  # noqa: E402

from offload_runner.report import markdown_table  # noqa: E402

LAYERS = 48  # Qwen3-30B-A3B's
# auto's line: "<choice> (peak P GB + M GB kept free fits G GB; host H of N GB per node; ...)"
PLANNED = re.compile(r"peak ([\d.]+) GB .*?host ([\d.]+) of")
HEADER = (
    "row",
    "GPUs",
    "layers",
    "status",
    "step s",
    "tokens/s",
    "TFLOP/s/GPU",
    "GPU peak GB (plan)",
    "host GB (plan)",
    "what auto chose",
)


@dataclass
class Row:
    name: str
    suite: str
    gpus: int
    layers: int
    status: str
    summary: dict
    command: str

    @property
    def planned(self) -> tuple[float, float] | None:
        """auto's planned GPU peak and host memory per node (None: not an auto run)."""
        found = PLANNED.search(self.summary.get("auto", ""))
        return (float(found[1]), float(found[2])) if found else None

    @property
    def host_gb(self) -> float | None:
        """The node's memory in use at its peak above what it used before the run."""
        s = self.summary
        if not s.get("host_used_gb_max_per_node"):
            return None
        return s["host_used_gb_max_per_node"][0] - s["host_used_gb_before_per_node"][0]

    @property
    def chose(self) -> str:
        return self.summary.get("auto", "").split(" (")[0]


def load(files: list[Path]) -> list[Row]:
    """Every row of the files, the latest run of a name (files in date order)."""
    calls = sorted(
        (json.loads(p.read_text()) for p in files), key=lambda d: d["environment"]["date"]
    )
    rows: dict[str, Row] = {}
    for d in calls:
        for r in d["results"]:
            command = " ".join(r["command"])
            layers = re.search(r"model\.num_layers=(\d+)", command)
            rows[r["case"]["name"]] = Row(
                name=r["case"]["name"],
                suite=d["suite"],
                gpus=r["case"].get("nproc", 1),
                layers=int(layers[1]) if layers else LAYERS,
                status=r["status"],
                summary=r["summary"] or {},
                command=command,
            )
    return sorted(rows.values(), key=lambda r: (r.gpus, r.layers, r.planned is not None))


def _measured_and_planned(measured: float | None, planned: float | None) -> str:
    if measured is None:
        return "-"
    return f"{measured:.1f}" + (f" ({planned:.1f})" if planned else "")


def table(rows: list[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        s, plan = r.summary, r.planned or (None, None)
        ok = r.status == "ok"
        out.append(
            [
                f"{r.name} (`{r.suite}`)",
                str(r.gpus),
                str(r.layers),
                r.status,
                f"{s['step_time_s_median']:.2f}" if ok else "-",
                f"{s['tokens_per_s_median']:,.0f}" if ok else "-",
                f"{s['tflops_per_gpu_median']:.0f}" if ok else "-",
                _measured_and_planned(s.get("gpu_peak_allocated_gb"), plan[0]),
                _measured_and_planned(r.host_gb, plan[1]),
                f"`{r.chose}`" if r.chose else "",
            ]
        )
    return out


def worst_error(rows: list[Row]) -> float:
    """The largest relative miss of the plan, GPU peak or host, over the auto rows that ran."""
    errors = [
        abs(measured / planned - 1)
        for r in rows
        if r.status == "ok" and r.planned
        for measured, planned in zip(
            (r.summary["gpu_peak_allocated_gb"], r.host_gb), r.planned, strict=True
        )
        if measured is not None
    ]
    return max(errors)


def render(files: list[Path], plot: Path | None) -> str:
    rows = load(files)
    env = json.loads(files[0].read_text())["environment"]
    lines = [
        "# What fits",
        "",
        "Qwen3-30B-A3B (48 layers, 30.5B params) and its slices on H200 boxes (139 GB per GPU, "
        "125 GB of RAM per GPU), MB 1, each `offload/optimizer=auto` run beside the same line "
        "without offload. In brackets what `--plan` promised (auto's own line of the run); host "
        "memory is the node's peak above what it used before the run. "
        f"megatron-core {env['megatron.core']}, transformer-engine {env['transformer_engine']}; "
        f"{', '.join(sorted({f.name for f in files}))}.",
        "",
        "## The runs\n",
        *markdown_table(HEADER, table(rows)),
        "",
        f"The plan's largest miss over these runs: {worst_error(rows):.1%}.",
        "",
        *planned_fits(),
    ]
    if plot is not None:
        draw(rows, plot)
        lines += [f"![measured against planned memory]({plot.name})", ""]
    return "\n".join([*lines, commands_block({r.name: r.command for r in rows})])


PLAN_LINE = ("train.global_batch_size=8", "train.micro_batch_size=1", "offload/optimizer=auto")


def planned_fits() -> list[str]:
    """What ``--plan --largest`` and ``--plan`` say fits on one and two H200 boxes (139 GB
    GPUs, 125 GB of RAM per GPU), planned here from the recipe as it is now."""
    from offload_runner.auto import choose_offload, largest_slice
    from offload_runner.config.compose import compose_config, to_run_config

    rows = []
    for gpus, layout in ((1, "parallel=single"), (2, "parallel=ep2")):
        memory = ("planner.gpu_memory_gb=139", f"planner.host_memory_gb={125 * gpus}")
        overrides = ["recipe=qwen3_30b_a3b", layout, *PLAN_LINE, *memory]
        run = to_run_config(compose_config(overrides))
        found = largest_slice(run, gpus)
        largest = found.choice.description.split(" (")[0] if found.choice else "as configured"
        try:
            whole = choose_offload(run, gpus).description.split(" (")[0]
        except ValueError:
            whole = "no offload setting fits"
        rows.append([f"{gpus} x H200", layout, f"{found.layers} layers: {largest}", whole])
    return [
        "## What `--plan` says fits\n",
        "Qwen3-30B-A3B at GBS 8, MB 1, `offload/optimizer=auto`, planned by this commit (the "
        "runs above were planned by theirs):",
        "",
        *markdown_table(["box", "layout", "largest slice", "whole model (48 layers)"], rows),
        "",
    ]


def draw(rows: list[Row], out: Path) -> None:
    """GPU peak and host memory of each auto run, measured beside planned."""
    plt = pyplot()
    ran = [r for r in rows if r.status == "ok" and r.planned]
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.5 * len(ran) + 1.6), sharey=True)
    y = range(len(ran))
    labels = [f"{r.name} ({r.gpus} GPU)" for r in ran]
    for ax, what, measured, planned in (
        (axes[0], "GPU peak GB", [r.summary["gpu_peak_allocated_gb"] for r in ran], 0),
        (axes[1], "host GB per node", [r.host_gb for r in ran], 1),
    ):
        ax.barh([i + 0.2 for i in y], measured, height=0.4, label="measured")
        ax.barh([i - 0.2 for i in y], [r.planned[planned] for r in ran], height=0.4, label="plan")
        ax.set(xlabel=what)
    axes[0].set_yticks(list(y), labels, fontsize=8)
    axes[1].legend(fontsize=8)
    save(fig, out)


if __name__ == "__main__":
    sys.exit(report_main(__doc__, render))
