"""The topic reports of docs/benchmarks that bench/capacity.py and bench/weight_offload.py
render from the recorded results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "bench"))
import capacity  # noqa: E402
import weight_offload  # noqa: E402

RESULTS = PROJECT_ROOT / "bench/results"
FILES = sorted(
    p
    for pattern in ("results-capacity-*.json", "results-whole-model.json", "results-two-gpu-full-*")
    for p in RESULTS.glob(pattern)
)


def test_a_row_reads_its_plan_from_autos_line_and_its_host_above_idle() -> None:
    row = capacity.Row(
        "r",
        "s",
        1,
        48,
        "ok",
        {
            "auto": "full recompute, offload/optimizer=states (peak 116.9 GB + 2.0 GB kept free "
            "fits 139.0 GB; host 118.3 of 125 GB per node; predicted 11.39 s a step)",
            "host_used_gb_max_per_node": [121.6],
            "host_used_gb_before_per_node": [3.1],
        },
        "",
    )
    assert row.planned == (116.9, 118.3) and abs(row.host_gb - 118.5) < 1e-9
    assert row.chose == "full recompute, offload/optimizer=states"


def test_every_largest_run_is_within_10_percent_of_its_plan_and_each_no_offload_line_ran_out():
    rows = capacity.load(FILES)
    assert {r.layers for r in rows if r.status == "ok"} >= {37, 48}
    assert capacity.worst_error(rows) < 0.10
    assert all(r.status == "OOM" for r in rows if "no offload" in r.name)
    text = capacity.render(FILES, plot=None)
    assert all(f"| {r.name} (`{r.suite}`) |" in text for r in rows)
    assert "| whole model auto (`whole-model`) | 1 | 48 | ok |" in text
    # and what --plan says now: the whole model fits one H200 box (8-bit moments) and two
    assert "| 1 x H200 | parallel=single | 48 layers: " in text
    assert "| 2 x H200 | parallel=ep2 | 48 layers: " in text


def test_weight_offload_lowers_every_peak_and_each_row_is_reported() -> None:
    files = sorted(RESULTS.glob("results-weight-offload*.json"))
    results = weight_offload.load(files)
    by_name = {r["case"]["name"]: r for r in results}
    pairs = [
        (r["summary"], by_name[r["case"]["baseline"]]["summary"])
        for r in results
        if r["status"] == "ok" and "weights of" in r["case"]["name"]
    ]
    assert len(pairs) >= 4
    for ran, base in pairs:  # a capped baseline ran out of memory: nothing to set beside
        assert not base or ran["gpu_peak_allocated_gb"] < base["gpu_peak_allocated_gb"]
    text = weight_offload.render(files, plot=None)
    assert all(f"| {r['case']['name']} | `{r['suite']}` " in text for r in results)
    assert "Weight offload against its link bound" in text


def test_gpu_tests_report_is_its_template_filled_from_the_evidence() -> None:
    """docs/benchmarks/gpu-tests.md is what bench/gpu_tests.py makes of its template now (rerun
    it after new evidence), every placeholder filled."""
    import gpu_tests

    made = gpu_tests.fill("gpu-tests.md", gpu_tests.PARTS)
    assert "{{" not in made and "pytest-gpu-h200.txt" in made
    assert (PROJECT_ROOT / "docs/benchmarks/gpu-tests.md").read_text() == made


def test_a_template_part_that_does_not_exist_is_an_error(tmp_path, monkeypatch) -> None:
    import fill

    monkeypatch.setattr(fill, "TEMPLATES", tmp_path)
    (tmp_path / "t.md").write_text("a {{known}} b {{count:x.txt}} c {{missing}}")
    parts = {"known": lambda: "K", "count": lambda name: f"<{name}>"}
    try:
        fill.fill("t.md", parts)
    except KeyError as e:
        assert "no part 'missing'" in str(e)
    else:
        raise AssertionError("an unknown part filled in silently")
    (tmp_path / "t.md").write_text("a {{known}} b {{count:x.txt}}")
    assert fill.fill("t.md", parts) == "a K b <x.txt>"


def test_forward_backward_report_is_its_template_filled_from_the_evidence() -> None:
    """docs/benchmarks/forward-backward.md is what bench/forward_backward.py makes now."""
    import forward_backward

    made = forward_backward.fill("forward-backward.md", forward_backward.PARTS)
    assert "{{" not in made and "| states |" in made and "cudaLaunchKernel" in made
    assert (PROJECT_ROOT / "docs/benchmarks/forward-backward.md").read_text() == made


def test_the_cpu_adam_report_is_its_template_filled() -> None:
    """docs/benchmarks/cpu-adam.md is what bench/fill.py makes of its template now."""
    import fill

    made = fill.fill("cpu-adam.md", fill.SHARED_PARTS)
    assert "{{" not in made and len(made.splitlines()) <= 300
    assert (PROJECT_ROOT / "docs/benchmarks/cpu-adam.md").read_text() == made


def test_a_results_table_sets_each_run_against_its_own_files_baseline(tmp_path, monkeypatch):
    """fill.table: a row per matching run, ``vs`` against the baseline of the run's own file,
    a failed run's status in its first column, the file named where there are several."""
    import fill

    def results(commit: str, base_s: float, run_s: float) -> dict:
        case = {"baseline": "base"}
        return {
            "environment": {"commit": commit},
            "results": [
                {
                    "case": {**case, "name": "base"},
                    "status": "ok",
                    "summary": {"step_time_s_median": base_s},
                },
                {
                    "case": {**case, "name": "run"},
                    "status": "ok",
                    "summary": {"step_time_s_median": run_s},
                },
                {"case": {**case, "name": "run big"}, "status": "oom", "summary": {}},
            ],
        }

    for name, data in {"a": results("aaa", 1.0, 1.5), "b": results("bbb", 2.0, 2.5)}.items():
        (tmp_path / f"results-{name}.json").write_text(json.dumps(data))
    monkeypatch.setattr(fill, "ROOT", tmp_path)
    lines = fill.table("results-*.json|run|step,vs").splitlines()
    assert lines[0] == "| run | call | step ms | vs baseline |"
    assert lines[2:] == [
        "| run | `a` aaa | 1500 | 1.50x |",
        "| run big | `a` aaa | oom | - |",
        "| run | `b` bbb | 2500 | 1.25x |",
        "| run big | `b` bbb | oom | - |",
    ]


def test_the_hf_finetune_report_is_its_template_filled() -> None:
    """docs/benchmarks/hf-finetune.md is what bench/hf_finetune.py makes of its template and
    the hf-finetune results now."""
    from fill import SHARED_PARTS, fill

    made = fill("hf-finetune.md", SHARED_PARTS) + "\n"
    assert "{{" not in made and "results-hf-finetune-r1.json" in made
    assert (PROJECT_ROOT / "docs/benchmarks/hf-finetune.md").read_text() == made


def test_readme_is_its_template_filled_and_a_screenful_of_screens() -> None:
    """README.md is what bench/readme.py makes of bench/templates/README.md from the results
    now (every measured figure in it a part), at most 200 lines."""
    from fill import fill
    from readme import PARTS

    made = fill("README.md", PARTS)
    assert "{{" not in made and "results-whole-model-fast-auto-r2" not in made
    assert (PROJECT_ROOT / "README.md").read_text() == made
    assert len(made.splitlines()) <= 200


def _results(*patterns: str) -> list[Path]:
    found = (PROJECT_ROOT / "bench" / "results").glob
    return sorted(path for pattern in patterns for path in found(pattern))


def _generated(name: str, plot: Path) -> str:
    """docs/benchmarks/``name`` as its generator makes it now (the command in its header)."""
    import calibrate_planner
    import capacity
    import convergence
    import weight_offload

    made = {
        "capacity.md": lambda: capacity.render(
            _results("results-capacity-*", "results-whole-model.json", "results-two-gpu-full-*"),
            plot,
        ),
        "weight-offload.md": lambda: weight_offload.render(_results("*weight-offload*"), plot),
        "convergence.md": lambda: convergence.render(_results("results-convergence-*"), plot),
        "planner.md": lambda: calibrate_planner.render_report(
            calibrate_planner.calibrate(_results("*.json")), 0.1, plot
        ),
        "step-model.md": lambda: calibrate_planner.render_step_report(_results("*.json"), plot),
    }
    return made[name]()


@pytest.mark.parametrize(
    "name", ["capacity.md", "weight-offload.md", "convergence.md", "planner.md", "step-model.md"]
)
def test_each_report_is_what_its_generator_makes_of_the_results(name: str, tmp_path) -> None:
    """Change a figure in the report or a result it reads, and this fails."""
    made = _generated(name, tmp_path / name.replace(".md", ".png"))
    assert (PROJECT_ROOT / "docs" / "benchmarks" / name).read_text().strip() == made.strip()


@pytest.mark.parametrize("report", sorted((PROJECT_ROOT / "docs" / "benchmarks").glob("*.md")))
def test_a_report_opens_with_a_summary_and_folds_long_tables(report: Path) -> None:
    """At most 15 lines (wrapped at 100) before its first section; no table of more than 20
    rows outside <details>."""
    import textwrap

    lines = report.read_text().splitlines()
    opening = []
    for line in lines[1:]:
        if line.startswith("## "):
            break
        opening.append(line)
    assert sum(max(1, len(textwrap.wrap(line, 100))) for line in opening) <= 15
    folded, rows = False, 0
    for line in lines:
        folded = (folded or line.startswith("<details>")) and not line.startswith("</details>")
        rows = rows + 1 if line.startswith("|") else 0
        assert folded or rows <= 22, f"{report.name}: a table of more than 20 rows, unfolded"
