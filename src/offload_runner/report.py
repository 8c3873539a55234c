"""What finished runs say, and how two runs compare: shared by --verify, sweep tables and the
benchmark report. Reads only run directories (summary.json, status.json, overrides.yaml)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from offload_runner.rundir import OVERRIDES_FILE, STATUS_FILE, SUMMARY_FILE, read_json


@dataclass
class RunResult:
    """One run directory's outcome."""

    path: Path
    status: str  # ok | oom | failed | missing
    summary: dict = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> RunResult:
        path = Path(path)
        summary = read_json(path / SUMMARY_FILE)
        status = read_json(path / STATUS_FILE).get("status") or ("ok" if summary else "missing")
        overrides_file = path / OVERRIDES_FILE
        overrides = list(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
        return cls(path, status, summary, [str(o) for o in overrides])

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.summary)

    @property
    def losses(self) -> list[float]:
        return list(self.summary.get("losses", []))

    @property
    def step_s(self) -> float | None:
        return self.summary.get("step_time_s_median")

    @property
    def peak_gb(self) -> float | None:
        return self.summary.get("gpu_peak_allocated_gb")

    @property
    def host_pinned_gb(self) -> float | None:
        return self.summary.get("host_pinned_gb_max")


def max_abs_delta(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Largest per-iteration |a - b| over the iterations both have (None if either is empty)."""
    if not a or not b:
        return None
    return max(abs(x - y) for x, y in zip(a, b, strict=False))


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def saved(value: float | None, base: float | None) -> float | None:
    return base - value if value is not None and base is not None else None


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


FOLD_ROWS = 20  # a longer table folds under <details>, so a report reads past it


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    table = [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    return folded(table)


def folded(table: list[str]) -> list[str]:
    """A Markdown table's lines (header and rule first) under <details> past FOLD_ROWS rows."""
    rows = len(table) - 2
    if rows <= FOLD_ROWS:
        return table
    return [f"<details><summary>the table: {rows} rows</summary>", "", *table, "", "</details>"]
