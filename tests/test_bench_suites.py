"""Every case of every bench suite passes validation and --plan arithmetic on the CPU, so a GPU
session never spends device time on a command line that is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT

from offload_runner.cli import EXIT_FAILED, EXIT_OK, main

sys.path.insert(0, str(PROJECT_ROOT / "bench"))
import run_benchmarks  # noqa: E402
import suite_report  # noqa: E402
import suites  # noqa: E402

CASES = {case.name: case for cases in suites.SUITES.values() for case in cases}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bench_case_is_accepted(name: str, tmp_path) -> None:
    case = CASES[name]
    args = [
        "--recipe",
        case.recipe,
        *case.overrides,
        f"launcher.nproc_per_node={case.nproc}",
        f"output_dir={tmp_path}/run",
    ]
    assert main([*args, "--dry-run"]) == EXIT_OK, name
    # the no-offload rows of the full model, of the capacity slice and under a GPU memory cap are
    # meant not to fit
    expected = EXIT_FAILED if name in suites.MEANT_NOT_TO_FIT else EXIT_OK
    if case.recipe == "qwen3_30b_a3b" or "planner.host_memory_gb=125" in case.overrides:
        assert main([*args, "--plan"]) == expected, name


def test_the_hidden_fraction_row_runs_at_the_fraction_its_delayed_row_reported() -> None:
    """Rounded down to a hundredth; nothing reported: unchanged."""
    cases = {c.name: c for c in suites.SUITES["cpu-adam-4"]}
    hidden = cases["GBS4 cpu_adam_delayed at its hidden fraction"]
    assert hidden.hidden_fraction_of == "GBS4 cpu_adam_delayed 100%"
    results = [
        {
            "case": {"name": hidden.hidden_fraction_of},
            "summary": {"cpu_adam_hidden_fraction": 0.2369},
        }
    ]
    assert run_benchmarks.at_hidden_fraction(hidden, results).overrides[-1] == (
        "optimizer.optimizer_offload_fraction=0.23"
    )
    assert run_benchmarks.at_hidden_fraction(hidden, []) == hidden


def test_a_long_run_goes_on_in_segments_from_where_the_last_call_saved(tmp_path) -> None:
    """--segment 500 of 2,000 iterations: the first call runs 0-500 and saves; the next resumes
    from the tracker at 500 and runs to 1,000 on the whole run's schedule; a finished case is
    not run again. Each segment's command line is accepted."""
    from offload_runner.checkpoint import LATEST

    case = next(c for c in suites.SUITES["convergence-long"] if "columns" in c.name)
    first, last, extra = run_benchmarks.segment_of(case, tmp_path, 2000, 500)
    assert (first, last) == (0, 500) and not any("checkpoint.load" in e for e in extra)
    saved = tmp_path / "checkpoints" / case.slug
    saved.mkdir(parents=True)
    (saved / LATEST).write_text("500")
    first, last, extra = run_benchmarks.segment_of(case, tmp_path, 2000, 500)
    assert (first, last) == (500, 1000)
    assert {"scheduler.lr_decay_iters=2000", f"checkpoint.load={saved}"} <= set(extra)
    command = case.command(tmp_path / "run", last, extra)
    args = [a for a in command[2:] if not a.startswith("checkpoint.load")]
    assert main([*args, "--dry-run"]) == EXIT_OK
    (saved / LATEST).write_text("2000")
    done = run_benchmarks.run_case(case, tmp_path, 2000, 500)
    assert (done.status, done.segment, done.command) == ("done", [2000, 2000], [])


def test_the_step_model_prices_the_exact_update_within_10_percent_on_the_cost_suites() -> None:
    """The step-time model (what --plan and auto price the exact engines at) against the measured
    steps of the issue's suites: within 10% once handed the run's own forward+backward, which the
    host's drift moves by more than that within one call (docs/BENCHMARKS.md); within 20% where
    the host had slowed by 1.3x or more since the call's start (no offload ran that much slower
    just before the row: the model prices the call's rates), as in gbs-4-pairs-2's second round
    (its CPU Adam 2.70 G params/s against 3.08 in the first)."""
    import calibrate_planner

    files = sorted((PROJECT_ROOT / "bench" / "results").glob("results-gbs-*.json"))
    rows = calibrate_planner.calibrate_steps(files)
    assert len(rows) >= 10
    slowed = [row for row in rows if row.host_slowdown >= 1.3]
    assert 0 < len(slowed) <= len(rows) // 5
    for row in rows:
        bound = 0.20 if row in slowed else 0.10
        assert abs(row.update_error) <= bound, (row.suite, row.case, row.update_error)
        given = row.predicted_s + row.fwd_bwd_drift_s
        assert row.update_error == pytest.approx((given - row.measured_s) / row.measured_s)
    report = calibrate_planner.render_step_report(files[:2], plot=None)  # step-model.md's form
    assert report.startswith("# Step-time model") and "| gbs-" in report


def test_a_suite_run_in_two_calls_reports_each_row_against_its_own_call() -> None:
    """gbs-4-beside ran at 14a2ce5 and again at a93c243 on a slower host: every row names its
    call, and each run's slowdown is against the no-offload run of its own call."""
    results = PROJECT_ROOT / "bench" / "results"
    files = [results / "results-gbs-4-beside-14a2ce5.json", results / "results-gbs-4-beside.json"]
    section = suite_report.render(files, suite="gbs-4-beside")
    assert "| cost GBS4 no offload (repeat) (gbs-4-beside-14a2ce5) |" in section
    for path in files:
        call = path.stem.removeprefix("results-")
        runs = {r["case"]["name"]: r["summary"] for r in json.loads(path.read_text())["results"]}
        base = runs["cost GBS4 no offload"]["step_time_s_median"]
        step = runs["cost GBS4 cpu_adam 100%"]["step_time_s_median"]
        row = next(
            x for x in section.splitlines() if x.startswith(f"| cost GBS4 cpu_adam 100% ({call}) |")
        )
        assert f" {step / base:.2f}x |" in row, row


def test_benchmarks_is_an_index_of_reports_headline_and_suites() -> None:
    """docs/BENCHMARKS.md from every committed result: at most 150 lines, a link per report,
    a row per suite no report holds, and no run's own table (those: ``report --suite``)."""
    files = sorted((PROJECT_ROOT / "bench" / "results").glob("*.json"))
    text = suite_report.render(files)
    assert len(text.splitlines()) <= 150
    for report in (PROJECT_ROOT / "docs" / "benchmarks").glob("*.md"):
        assert f"(benchmarks/{report.name})" in text
    assert "| `cpu-adam` | 2 |" in text and "`throughput`" not in text and "`gbs-4`" not in text
    assert "loss curves" not in text and "## Suite `" not in text


def test_the_optimizer_offload_report_fills_its_template() -> None:
    """bench/gbs_report.py: the template's words with every part filled in, under 300
    lines, as committed in docs/benchmarks."""
    import gbs_report

    text = gbs_report.report()
    assert "{{" not in text and len(text.splitlines()) <= 300
    assert "| 32 | `gbs-32-beside" in text
    committed = PROJECT_ROOT / "docs" / "benchmarks" / "optimizer-offload.md"
    assert committed.read_text().strip() == text.strip()


def _code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not a docstring."""
    import ast
    import io
    import tokenize

    text = path.read_text()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines = {
        n
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type not in skip | {tokenize.ENDMARKER}
        for n in range(tok.start[0], tok.end[0] + 1)
    }
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines -= set(range(first.lineno, first.end_lineno + 1))
    return len(lines)


def test_bench_outside_its_probes_stays_under_3160_code_lines() -> None:
    """bench/ as a small product: suites, runner, reports and their analyses; one-off
    measurements live in bench/probes/. No shell file carries Python of its own. (3,000 until
    the hf-finetune suite, whose import -> fine-tune -> export pipeline the runner does not
    express, added ~80; 3,100 until runs longer than a device call, in segments, and their
    two-seed verdict, ~55.)"""
    bench = PROJECT_ROOT / "bench"
    files = [p for p in bench.rglob("*.py") if "probes" not in p.relative_to(bench).parts]
    assert sum(_code_lines(p) for p in files) <= 3160
    for script in bench.rglob("*.sh"):
        assert "<<" not in script.read_text() and "python -c" not in script.read_text(), script
