"""``--collect SWEEP_DIR``: the runs of a Hydra multirun sweep as one table and one plot.

    python run_recipe.py -m --recipe R optimizer.optimizer_cpu_offload=true \\
        optimizer.optimizer_offload_fraction=0,0.25,0.5,0.75,1.0
    python run_recipe.py --collect multirun/2026-11-21/10-00-00-R

Each job folder of the sweep is an ordinary run directory. The table has one row per job
(config, status incl. OOM, step ms, slowdown, peak GPU GB, memory saved, pinned host GB); the
reference row is the first job with no offload (else the first job). Written next to the jobs:
``sweep.md``, ``sweep.json`` and ``sweep.png`` (step time and peak memory against the swept
value; needs matplotlib).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

from offload_runner import console
from offload_runner.report import RunResult, fmt, markdown_table, ratio, saved
from offload_runner.rundir import CONFIG_FILE, load_resolved

TABLE_MD, TABLE_JSON, PLOT_PNG = "sweep.md", "sweep.json", "sweep.png"


@dataclass
class SweepRow:
    job: str
    label: str  # the swept overrides of this job
    value: str  # the first swept key's value (the plot's x)
    status: str
    step_ms: float | None
    slowdown: float | None
    peak_gb: float | None
    saved_gb: float | None
    host_pinned_gb: float | None
    offload: bool


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job folders in job order (Hydra names them 0, 1, 2, ...)."""
    jobs = [p for p in Path(sweep_dir).iterdir() if (p / CONFIG_FILE).is_file()]
    return sorted(
        jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)
    )


def swept_keys(results: list[RunResult]) -> list[str]:
    """Override keys whose value differs between jobs, in first-seen order."""
    values: dict[str, set[str]] = {}
    for r in results:
        for override in r.overrides:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    return [k for k, v in values.items() if len(v) > 1 or len(results) == 1]


def collect(sweep_dir: Path) -> list[SweepRow]:
    from offload_runner.offload import any_enabled

    jobs = job_dirs(sweep_dir)
    if not jobs:
        raise ValueError(f"{sweep_dir} holds no run directories (no */{CONFIG_FILE})")
    results = [RunResult.load(j) for j in jobs]
    offloading = [any_enabled(load_resolved(j)) for j in jobs]
    keys = swept_keys(results)
    reference = next(
        (r for r, off in zip(results, offloading, strict=True) if not off and r.ok),
        next((r for r in results if r.ok), None),
    )
    rows = []
    for job, result, off in zip(jobs, results, offloading, strict=True):
        chosen = dict(o.partition("=")[::2] for o in result.overrides)
        base = reference if reference is not result else None
        rows.append(
            SweepRow(
                job=job.name,
                label=" ".join(f"{k}={chosen[k]}" for k in keys if k in chosen) or job.name,
                value=chosen.get(keys[0], job.name) if keys else job.name,
                status=result.status,
                step_ms=result.step_s * 1000 if result.step_s else None,
                slowdown=ratio(result.step_s, reference.step_s) if reference else None,
                peak_gb=result.peak_gb,
                saved_gb=saved(result.peak_gb, base.peak_gb) if base else None,
                host_pinned_gb=result.host_pinned_gb,
                offload=off,
            )
        )
    return rows


HEADERS = ("config", "status", "step ms", "slowdown", "peak GPU GB", "saved GB", "pinned host GB")


def _cells(row: SweepRow) -> list[str]:
    return [
        row.label,
        row.status.upper() if row.status == "oom" else row.status,
        fmt(row.step_ms, ".1f"),
        fmt(row.slowdown, ".2f", "x"),
        fmt(row.peak_gb),
        fmt(row.saved_gb, "+.2f"),
        fmt(row.host_pinned_gb),
    ]


def render_markdown(rows: list[SweepRow], sweep_dir: Path) -> str:
    return "\n".join(
        [f"# sweep `{sweep_dir}`", "", *markdown_table(HEADERS, [_cells(r) for r in rows]), ""]
    )


def plot(rows: list[SweepRow], path: Path, title: str) -> bool:
    """Step time and peak GPU memory against the swept value; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [r.value for r in rows]
    x = list(range(len(rows)))
    fig, left = plt.subplots(figsize=(7, 4))
    right = left.twinx()
    ok = [i for i, r in enumerate(rows) if r.step_ms is not None]
    left.plot([x[i] for i in ok], [rows[i].step_ms for i in ok], "o-", color="tab:blue")
    right.plot([x[i] for i in ok], [rows[i].peak_gb for i in ok], "s--", color="tab:red")
    for i, r in enumerate(rows):
        if r.status != "ok":
            left.annotate(r.status.upper(), (x[i], 0), color="black", ha="center")
    left.set_xticks(x, labels)
    left.set_xlabel(rows[0].label.partition("=")[0] if rows else "job")
    left.set_ylabel("step time (ms)", color="tab:blue")
    right.set_ylabel("peak GPU memory (GB)", color="tab:red")
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    left.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_table(rows: list[SweepRow], title: str) -> None:
    table = Table(title=title, title_justify="left")
    for name in HEADERS:
        table.add_column(name, justify="left" if name in ("config", "status") else "right")
    for r in rows:
        table.add_row(*_cells(r), style="red" if r.status != "ok" else "")
    console.console.print(table)


def collect_and_report(sweep_dir: Path) -> int:
    """The --collect command: table on the console, sweep.md / sweep.json / sweep.png on disk."""
    try:
        rows = collect(sweep_dir)
    except ValueError as err:
        console.fail(str(err), "pass the folder a multirun printed (multirun/<date>/<time>-<name>)")
        return 2
    title = f"sweep {sweep_dir} ({len(rows)} runs)"
    print_table(rows, title)
    (sweep_dir / TABLE_MD).write_text(render_markdown(rows, sweep_dir))
    (sweep_dir / TABLE_JSON).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    written = [TABLE_MD, TABLE_JSON]
    if plot(rows, sweep_dir / PLOT_PNG, title):
        written.append(PLOT_PNG)
    else:
        console.console.print("[yellow]note:[/] the plot needs matplotlib (pip install matplotlib)")
    console.console.print(f"wrote {', '.join(written)} in [bold]{sweep_dir}[/]")
    return 0
