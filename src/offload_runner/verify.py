"""``--verify``: is this offload setting safe? The recipe runs twice on the same data and seed,
without offload and with the requested offload, for ``verify.iters`` iterations; the report
compares losses per iteration, peak GPU memory (against what the planner says the offload should
save) and step time, and ends with PASS (exit 0) or FAIL (exit 1).

Run directory: ``baseline/`` and ``offload/`` (and ``baseline-repeat/``) are ordinary run
directories; ``verify.md`` and ``verify.json`` hold the report.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from offload_runner import console
from offload_runner.config.compose import to_run_config
from offload_runner.config.schema import RunConfig
from offload_runner.offload import disabled_overrides
from offload_runner.plan import GiB, make_plan
from offload_runner.report import RunResult, fmt, markdown_table, max_abs_delta, ratio, saved

REPORT_MD, REPORT_JSON = "verify.md", "verify.json"


def variant(cfg: DictConfig, run: RunConfig, offload: bool) -> DictConfig:
    """The config of one verify run: short, checkpoint-free, deterministic if asked, and for the
    baseline with every offload mechanism off."""
    out = copy.deepcopy(cfg)
    changes: dict[str, object] = {
        "train.train_iters": run.verify.iters,
        "checkpoint.save": None,
        "checkpoint.load": None,
        "planner.auto_optimizer": False,
        "planner.auto_activation": False,
    }
    if run.verify.deterministic:
        changes["model.deterministic_mode"] = True
    if not offload:
        changes.update(disabled_overrides())
    for key, value in changes.items():
        OmegaConf.update(out, key, value)
    return out


@dataclass
class Criterion:
    name: str
    passed: bool
    detail: str


@dataclass
class VerifyReport:
    """The comparison of the two runs, and the verdict."""

    recipe: str
    overrides: list[str]
    iters: int
    loss_tolerance: float
    baseline: dict
    offload: dict
    losses: list[tuple[int, float | None, float | None]]
    max_delta: float | None
    noise_floor: float | None
    saved_gb: float | None
    expected_saved_gb: float
    step_ratio: float | None
    criteria: list[Criterion] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.criteria) and all(c.passed for c in self.criteria)


def compare(
    run: RunConfig,
    overrides: Sequence[str],
    baseline: RunResult,
    offload: RunResult,
    expected_saved_gb: float,
    repeat: RunResult | None = None,
) -> VerifyReport:
    """Judge two finished runs against the criteria: both completed every iteration, max
    |Δloss| below the tolerance, and peak GPU memory lower with offload."""
    iters = run.verify.iters
    b, o = baseline.losses, offload.losses
    losses = [
        (i + 1, b[i] if i < len(b) else None, o[i] if i < len(o) else None)
        for i in range(max(len(b), len(o)))
    ]
    delta = max_abs_delta(b, o)
    noise = max_abs_delta(b, repeat.losses) if repeat and repeat.ok else None
    memory_saved = saved(offload.peak_gb, baseline.peak_gb)
    tol = run.verify.loss_tolerance
    criteria = [
        Criterion(
            "baseline completed",
            baseline.ok and len(b) == iters,
            f"{baseline.status}, {len(b)}/{iters} iterations",
        ),
        Criterion(
            "offload completed",
            offload.ok and len(o) == iters,
            f"{offload.status}, {len(o)}/{iters} iterations",
        ),
        Criterion(
            "loss matches",
            delta is not None and delta < tol,
            f"max |Δloss| {fmt(delta, '.2e')} (tolerance {tol:.0e})"
            + (f"; baseline vs its repeat: {noise:.2e}" if noise is not None else ""),
        ),
        Criterion(
            "memory reduced",
            memory_saved is not None and memory_saved > 0,
            f"peak GPU {fmt(baseline.peak_gb)} → {fmt(offload.peak_gb)} GB "
            f"(saved {fmt(memory_saved)} GB, planner expects {expected_saved_gb:.2f} GB)",
        ),
    ]
    return VerifyReport(
        recipe=run.name,
        overrides=list(overrides),
        iters=iters,
        loss_tolerance=tol,
        baseline=_brief(baseline),
        offload=_brief(offload),
        losses=losses,
        max_delta=delta,
        noise_floor=noise,
        saved_gb=memory_saved,
        expected_saved_gb=expected_saved_gb,
        step_ratio=ratio(offload.step_s, baseline.step_s),
        criteria=criteria,
    )


def _brief(result: RunResult) -> dict:
    return {
        "path": str(result.path),
        "status": result.status,
        "step_s": result.step_s,
        "peak_gb": result.peak_gb,
        "host_pinned_gb": result.host_pinned_gb,
    }


def expected_saving_gb(baseline: RunConfig, offload: RunConfig) -> float:
    """What the planner says the offload saves on the worst rank."""
    return (make_plan(baseline).worst.gpu_peak - make_plan(offload).worst.gpu_peak) / GiB


def render_markdown(report: VerifyReport) -> str:
    verdict = "PASS" if report.passed else "FAIL"
    lines = [
        f"# verify: {report.recipe} — {verdict}",
        "",
        f"Overrides: `{' '.join(report.overrides) or '(none)'}` · {report.iters} iterations · "
        f"loss tolerance {report.loss_tolerance:.0e}",
        "",
        *markdown_table(
            ["criterion", "result", "detail"],
            [[c.name, "pass" if c.passed else "**FAIL**", c.detail] for c in report.criteria],
        ),
        "",
        *markdown_table(
            ["", "baseline", "offload"],
            [
                [
                    "step time ms",
                    fmt(_ms(report.baseline["step_s"]), ".1f"),
                    fmt(_ms(report.offload["step_s"]), ".1f"),
                ],
                ["peak GPU GB", fmt(report.baseline["peak_gb"]), fmt(report.offload["peak_gb"])],
                [
                    "pinned host GB",
                    fmt(report.baseline["host_pinned_gb"]),
                    fmt(report.offload["host_pinned_gb"]),
                ],
            ],
        ),
        "",
        f"Step-time ratio {fmt(report.step_ratio, '.2f', 'x')}; memory saved "
        f"{fmt(report.saved_gb)} GB of {report.expected_saved_gb:.2f} GB expected.",
        "",
        *markdown_table(
            ["iter", "baseline loss", "offload loss", "abs Δ"],
            [
                [
                    str(i),
                    fmt(b, ".6f"),
                    fmt(o, ".6f"),
                    fmt(abs(b - o) if b is not None and o is not None else None, ".2e"),
                ]
                for i, b, o in report.losses
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def print_report(report: VerifyReport) -> None:
    table = Table(title=f"verify {report.recipe}: loss per iteration", title_justify="left")
    for name in ("iter", "baseline", "offload", "|Δ|"):
        table.add_column(name, justify="right")
    for i, b, o in report.losses:
        d = abs(b - o) if b is not None and o is not None else None
        style = "red" if d is not None and d >= report.loss_tolerance else ""
        table.add_row(str(i), fmt(b, ".5f"), fmt(o, ".5f"), fmt(d, ".2e"), style=style)
    console.console.print(table)
    checks = Table(title="criteria", title_justify="left")
    for name in ("criterion", "result", "detail"):
        checks.add_column(name)
    for c in report.criteria:
        checks.add_row(c.name, "[green]pass[/]" if c.passed else "[bold red]FAIL[/]", c.detail)
    checks.add_row("step time", "", f"{fmt(report.step_ratio, '.2f', 'x')} the baseline's")
    console.console.print(checks)
    verdict = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
    console.console.print(f"verify: {verdict}")


def write_report(report: VerifyReport, run_dir: Path) -> None:
    (run_dir / REPORT_MD).write_text(render_markdown(report))
    (run_dir / REPORT_JSON).write_text(
        json.dumps(asdict(report) | {"passed": report.passed}, indent=1)
    )


def verify(run: RunConfig, cfg: DictConfig, run_dir: Path, overrides: Sequence[str]) -> int:
    """Run baseline and offload (and a baseline repeat), report, and return 0 (PASS) / 1."""
    from offload_runner.launch import launch

    configs = {"baseline": variant(cfg, run, offload=False), "offload": variant(cfg, run, True)}
    if run.verify.repeat_baseline:
        configs["baseline-repeat"] = configs["baseline"]
    results: dict[str, RunResult] = {}
    for name, sub_cfg in configs.items():
        console.console.rule(f"verify: {name} run")
        sub_run = to_run_config(sub_cfg)
        resolved = OmegaConf.to_container(sub_cfg, resolve=True, enum_to_str=True)
        launch(sub_run, resolved, overrides, run_dir / name)
        results[name] = RunResult.load(run_dir / name)
    report = compare(
        run,
        overrides,
        results["baseline"],
        results["offload"],
        expected_saving_gb(to_run_config(configs["baseline"]), to_run_config(configs["offload"])),
        results.get("baseline-repeat"),
    )
    print_report(report)
    write_report(report, run_dir)
    console.console.print(f"report: [bold]{run_dir / REPORT_MD}[/] and {REPORT_JSON}")
    return 0 if report.passed else 1
