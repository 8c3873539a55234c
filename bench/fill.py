#!/usr/bin/env python
"""Reports from Markdown templates: the words live in bench/templates/, each ``{{part}}`` or
``{{part:argument}}`` in them is filled by a function of the report's module from the results
and evidence files (so no figure in a report is typed by hand)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from suites import CONVERGENCE_TAIL  # noqa: E402

from offload_runner.report import fmt, markdown_table, max_abs_delta, ratio  # noqa: E402

EVIDENCE = ROOT / "docs" / "evidence"
TEMPLATES = Path(__file__).resolve().parent / "templates"
PLACEHOLDER = re.compile(r"\{\{(\w+)(?::([^}]*))?\}\}")


def fill(template: str, parts: dict[str, Callable[..., str]]) -> str:
    """bench/templates/``template`` with every placeholder replaced by its part's text (a
    part with an argument is called with it). An unknown part is an error, not a blank."""
    text = (TEMPLATES / template).read_text()

    def one(match: re.Match) -> str:
        name, argument = match.groups()
        if name not in parts:
            raise KeyError(f"{template}: no part {name!r} (parts: {', '.join(sorted(parts))})")
        return parts[name]() if argument is None else parts[name](argument)

    return PLACEHOLDER.sub(one, text)


def printed(part: Callable[[], None]) -> Callable[[], str]:
    """A part written with print(), run from the project root: its output as the part's text."""

    @functools.wraps(part)
    def text() -> str:
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.chdir(ROOT):
            part()
        return out.getvalue().rstrip("\n")

    return text


# Parts that quote docs/evidence files, ``FILE|ARGUMENT`` after the part's name.
def first(argument: str) -> str:
    """``FILE|REGEX``: REGEX's first match in the evidence file."""
    name, pattern = argument.split("|", 1)
    found = re.search(pattern, (EVIDENCE / name).read_text(), re.M)
    return found.group(0) if found else f"(no {pattern!r} in {name})"


def value(argument: str) -> str:
    """``FILE|KEY.KEY...|FORMAT``: one figure of a results file (from the project root)."""
    name, keys, spec = argument.split("|")
    found = json.loads((ROOT / name).read_text())
    for key in keys.split("."):
        found = found[int(key) if key.isdigit() else key]
    return format(found, spec)


def matching(argument: str) -> str:
    """``FILE|REGEX``: the evidence file's lines that match, each a list item."""
    name, pattern = argument.split("|", 1)
    lines = (EVIDENCE / name).read_text().splitlines()
    return "\n".join(f"- {ln}" for ln in lines if re.match(pattern, ln))


def count(argument: str) -> str:
    """``FILE|TEXT``: how many times TEXT stands in the evidence file."""
    name, text = argument.split("|", 1)
    return str((EVIDENCE / name).read_text().count(text))


def tail(argument: str) -> str:
    """``FILE|N``: the evidence file from its N-th line on."""
    name, start = argument.split("|")
    return "\n".join((EVIDENCE / name).read_text().splitlines()[int(start) - 1 :])


def _ms(key: str) -> Callable[[dict, dict], str]:
    return lambda s, _: fmt(s[key] * 1000 if s.get(key) is not None else None, ".0f")


def _of(key: str, spec: str, scale: float = 1.0, suffix: str = "") -> Callable[[dict, dict], str]:
    return lambda s, _: fmt(s[key] / scale if s.get(key) is not None else None, spec, suffix)


def _vs(key: str) -> Callable[[dict, dict], str]:
    """``key`` over the baseline's (none on the baseline itself)."""

    def cell(s: dict, base: dict) -> str:
        return fmt(None if s is base else ratio(s.get(key), base.get(key)), ".2f", "x")

    return cell


def _update(s: dict, _: dict) -> str:
    found = [s[k] for k in ("cpu_adam_wall_s_median", "cpu_adam_stream_s_median") if s.get(k)]
    return fmt(max(found) * 1000 if found else None, ".0f")


def _rest(s: dict, _: dict) -> str:
    fwd_bwd = s.get("fwd_bwd_time_s_median")
    return fmt((s["step_time_s_median"] - fwd_bwd) * 1000 if fwd_bwd else None, ".0f")


def tail_mean(losses: list[float], n: int = CONVERGENCE_TAIL) -> float:
    return statistics.fmean(losses[-n:])


def _tail(s: dict, _: dict) -> str:
    return fmt(tail_mean(s["losses"]) if s.get("losses") else None, ".4f")


def _delta(s: dict, base: dict) -> str:
    same = s is base
    return "-" if same else fmt(max_abs_delta(s.get("losses", []), base.get("losses", [])), ".1e")


# A results table's columns: (header, the cell from a run's summary and its baseline's).
COLUMNS: dict[str, tuple[str, Callable[[dict, dict], str]]] = {
    "step": ("step ms", _ms("step_time_s_median")),
    "vs": ("vs baseline", _vs("step_time_s_median")),
    "fwd_bwd": ("fwd+bwd ms", _ms("fwd_bwd_time_s_median")),
    "rest": ("rest of the step ms", _rest),
    "peak": ("peak GPU GB", _of("gpu_peak_allocated_gb", ".2f")),
    "peak_vs": ("peak vs baseline", _vs("gpu_peak_allocated_gb")),
    "pinned": ("pinned host GB", _of("host_pinned_gb_max", ".1f")),
    "share": ("GPU share", _of("cpu_adam_gpu_share", ".2f")),
    "busy": ("CPU Adam ms", _ms("cpu_adam_busy_s_median")),
    "update": ("whole update ms", _update),
    "waited": ("step() waited ms", _ms("cpu_adam_boundary_s_median")),
    "phase": ("optimizer phase ms", _ms("optimizer_time_s_median")),
    "cpu_part": ("CPU part ms", _ms("cpu_adam_wall_s_median")),
    "share_pass": ("GPU share's pass ms", _ms("cpu_adam_stream_s_median")),
    "pass": ("state pass ms", _ms("states_stream_s_median")),
    "link": ("link GB/s each way", _of("states_link_gb_per_s", ".1f")),
    "states_gb": ("states on the host GB", _of("states_host_gb", ".1f")),
    "beside": ("pass after the forward's first wait ms", _ms("states_beside_forward_s")),
    "fwd_wait": ("the forward waited ms", _ms("states_forward_wait_s_median")),
    "grad_wait": ("waited for gradients ms", _ms("cpu_adam_wait_s_median")),
    "hidden": ("hidden fraction", _of("cpu_adam_hidden_fraction", ".3f")),
    "offloaded": ("offloaded params", _of("cpu_offloaded_params", ".2f", 1e9, "B")),
    "delayed": ("delayed params", _of("cpu_adam_delayed_params", ".2f", 1e9, "B")),
    "startup": ("optimizer start-up s", lambda s, _: fmt(s.get("startup_s", {}).get("optimizer"))),
    "auto": ("auto's pick", lambda s, _: (s.get("auto") or "-").split(" (")[0]),
    "first_loss": ("first loss", _of("first_loss", ".2f")),
    "loss": ("final loss", _of("final_loss", ".4f")),
    "valid": (
        "validation loss",
        lambda s, _: fmt((s.get("validation_losses") or [[0, None]])[-1][1], ".2f"),
    ),
    "tail": (f"loss, last {CONVERGENCE_TAIL}", _tail),
    "dloss": ("max abs Δloss vs baseline", _delta),
}


def table(argument: str) -> str:
    """``GLOBS|CASES|COLUMNS``: the runs of the results files GLOBS (from the project root,
    commas between) whose case name matches the regex CASES, a row each with COLUMNS (names of
    ``COLUMNS``, commas), each against its own file's baseline; with several files, a column
    says each row's file."""
    patterns, rest = argument.split("|", 1)
    cases, columns = rest.rsplit("|", 1)
    files = [f for pattern in patterns.split(",") for f in sorted(ROOT.glob(pattern))]
    if not files:
        raise FileNotFoundError(f"table: no results file matches {patterns}")
    names = columns.split(",")
    rows = []
    for path in files:
        data = json.loads(path.read_text())
        by = {r["case"]["name"]: r.get("summary", {}) for r in data["results"]}
        for r in data["results"]:
            if not re.search(cases, r["case"]["name"]):
                continue
            s, base = r.get("summary", {}), by.get(r["case"]["baseline"], {})
            if r["status"] == "ok":
                cells = [COLUMNS[n][1](s, base) for n in names]
            else:
                cells = [r["status"], *("-" for _ in names[1:])]
            call = [f"`{path.stem.removeprefix('results-')}` {data['environment']['commit'][:7]}"]
            rows.append([r["case"]["name"], *(call if len(files) > 1 else []), *cells])
    headers = ["run", *(["call"] if len(files) > 1 else []), *(COLUMNS[n][0] for n in names)]
    return "\n".join(markdown_table(headers, rows))


def convergence(results: list[dict]) -> dict | None:
    """Runs named ``... seed N``: each configuration's final loss (the mean of the last
    CONVERGENCE_TAIL iterations) per seed, set against the baseline's spread across seeds.
    ``within_noise``: the configuration's mean over seeds is within that spread of the
    baseline's mean."""
    finals: dict[str, dict[int, float]] = {}
    baseline = None
    for r in results:
        match = re.fullmatch(r"(.*) seed (\d+)", r["case"]["name"])
        if not match or r["status"] != "ok":
            continue
        finals.setdefault(match[1], {})[int(match[2])] = tail_mean(r["summary"]["losses"])
        if r["case"]["name"] == r["case"]["baseline"]:
            baseline = match[1]
    if baseline is None or len(finals.get(baseline, {})) < 2:
        return None
    base = finals[baseline]
    spread = max(base.values()) - min(base.values())
    rows = {}
    for name, by_seed in finals.items():
        if name != baseline:
            gap = statistics.fmean(by_seed.values()) - statistics.fmean(base.values())
            rows[name] = {"final": by_seed, "gap": gap, "within_noise": abs(gap) <= spread}
    return {"baseline": baseline, "baseline_final": base, "spread": spread, "runs": rows}


def seeds(pattern: str) -> str:
    """``GLOB``: each configuration of those results files against the baseline's seeds."""
    results = [
        r for path in sorted(ROOT.glob(pattern)) for r in json.loads(path.read_text())["results"]
    ]
    found = convergence(results)
    if found is None:
        raise ValueError(f"seeds: {pattern} holds no baseline run on two seeds")
    return "\n".join(
        f"- {name}: mean final loss {row['gap']:+.4f} against the baseline's, "
        f"{'within' if row['within_noise'] else 'outside'} its spread across seeds "
        f"({found['spread']:.4f})"
        for name, row in found["runs"].items()
    )


# The parts every report's template may use: evidence quotes, results tables, seeds' verdicts.
SHARED_PARTS = {
    "first": first,
    "value": value,
    "matching": matching,
    "count": count,
    "tail": tail,
    "table": table,
    "seeds": seeds,
}


def main() -> int:
    """``python bench/fill.py NAME``: bench/templates/NAME.md filled with the evidence and
    table parts alone, on stdout."""
    names = sorted(p.stem for p in TEMPLATES.glob("*.md") if p.stem != "README")  # readme.py's
    if len(sys.argv) != 2 or sys.argv[1] not in names:
        print(f"usage: python bench/fill.py {{{'|'.join(names)}}}", file=sys.stderr)
        return 2
    print(fill(f"{sys.argv[1]}.md", SHARED_PARTS), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
