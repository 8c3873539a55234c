#!/usr/bin/env python
"""README.md from bench/templates/README.md: every measured figure in it is a part filled from a
results file of bench/results (tests/test_reports.py holds README.md to what this makes).

    python bench/readme.py > README.md

Parts beside fill.py's: ``{{run:STEM|CASE|KEY|FORMAT}}`` a run's summary figure (the median
over that case's runs in results-STEM.json), ``{{calls:STEMS|BASE|CASE|KEY}}`` CASE's KEY over
BASE's in each call (results file) that ran both, ``{{gap:ROW|FORMAT}}`` a convergence row's
final validation loss against its reference's, ``{{auto:STEM|CASE}}`` what auto picked.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import convergence
from fill import SHARED_PARTS, fill

RESULTS = Path(__file__).resolve().parent / "results"


def _summaries(stem: str, case: str) -> list[dict]:
    data = json.loads((RESULTS / f"results-{stem}.json").read_text())
    return [r["summary"] for r in data["results"] if r["case"]["name"] == case] or [{}]


def _median(stem: str, case: str, key: str) -> float:
    return statistics.median(s[key] for s in _summaries(stem, case))  # KeyError: no such run


def run(argument: str) -> str:
    stem, case, key, spec = argument.split("|")
    return format(_median(stem, case, key), spec)


def calls(argument: str) -> str:
    """Each call's ratio, " / " between calls (never one ratio pooled over calls)."""
    stems, base, case, key = argument.split("|")
    ratios = (_median(stem, case, key) / _median(stem, base, key) for stem in stems.split(","))
    return " / ".join(f"{r:.2f}x" for r in ratios)


def gap(argument: str) -> str:
    row, spec = argument.split("|")
    rows, _ = convergence.load(sorted(RESULTS.glob("*convergence-*.json")))
    return format(convergence.gap(rows, row), spec)


def auto(argument: str) -> str:
    """What auto picked, without its reasons."""
    return _summaries(*argument.split("|"))[0]["auto"].split(" (")[0]


PARTS = {**SHARED_PARTS, "run": run, "calls": calls, "gap": gap, "auto": auto}


if __name__ == "__main__":
    sys.exit(print(fill("README.md", PARTS), end=""))
