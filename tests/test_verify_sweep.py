"""--verify's comparison and verdict, and the sweep table/plot, from recorded run directories
(what training writes: config.yaml, overrides.yaml, summary.json, status.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from offload_runner.cli import EXIT_USAGE, main, split_argv
from offload_runner.config.compose import compose_config, to_run_config
from offload_runner.report import RunResult
from offload_runner.rundir import create_run_dir, write_status
from offload_runner.sweep import collect, collect_and_report
from offload_runner.validation import Environment, validate
from offload_runner.verify import compare, render_markdown, variant, write_report

LOSSES = [10.0, 9.5, 9.1, 8.8]


def record_run(
    path: Path,
    overrides: list[str],
    losses: list[float] | None,
    peak: float,
    step_s: float = 0.4,
    status: str = "ok",
) -> Path:
    """A run directory as the trainer leaves it."""
    cfg = compose_config(["recipe=tiny", *overrides])
    create_run_dir(path, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), overrides)
    if losses is not None:
        summary = {
            "losses": losses,
            "step_time_s_median": step_s,
            "gpu_peak_allocated_gb": peak,
            "host_pinned_gb_max": 0.0,
            "iterations": len(losses),
        }
        (path / "summary.json").write_text(json.dumps(summary))
    write_status(path, status)
    return path


def run_of(*overrides: str):
    return to_run_config(compose_config(["recipe=tiny", *overrides]))


def test_verify_baseline_of_the_delayed_cpu_adam_engine_is_valid() -> None:
    cfg = compose_config(["recipe=tiny", "offload/optimizer=cpu_adam_delayed"])
    base = to_run_config(variant(cfg, to_run_config(cfg), offload=False))
    assert not base.optimizer.optimizer_cpu_offload and not base.optimizer.cpu_adam_delayed_update
    found = {v.rule for v in validate(base, Environment(te_available=True, launching=True))}
    assert not found & {"delayed_update_needs_cpu_adam", "cpu_adam_needs_cpu_offload"}


def test_verify_baseline_switches_every_offload_off() -> None:
    cfg = compose_config(["recipe=tiny", "offload/optimizer=cpu_50", "offload/activation=enabled"])
    run = to_run_config(cfg)
    base = to_run_config(variant(cfg, run, offload=False))
    off = to_run_config(variant(cfg, run, offload=True))
    assert not base.optimizer.optimizer_cpu_offload and not base.model.cpu_offloading
    assert off.optimizer.optimizer_offload_fraction == 0.5 and off.model.cpu_offloading
    for r in (base, off):
        assert r.train.train_iters == run.verify.iters and r.model.deterministic_mode
        assert r.checkpoint.save is None


def test_verify_passes_when_losses_match_and_memory_drops(tmp_path: Path) -> None:
    run = run_of("offload/optimizer=cpu_50", "verify.iters=4")
    base = RunResult.load(record_run(tmp_path / "b", [], LOSSES, peak=10.0))
    off = RunResult.load(
        record_run(tmp_path / "o", [], [x + 2e-4 for x in LOSSES], peak=7.0, step_s=0.8)
    )
    report = compare(run, ["offload/optimizer=cpu_50"], base, off, expected_saved_gb=3.2)
    assert report.passed
    assert report.max_delta == pytest.approx(2e-4)
    assert report.saved_gb == pytest.approx(3.0) and report.step_ratio == pytest.approx(2.0)
    write_report(report, tmp_path)
    md = (tmp_path / "verify.md").read_text()
    assert "PASS" in md and "planner expects 3.20 GB" in md
    assert json.loads((tmp_path / "verify.json").read_text())["passed"] is True


def test_verify_fails_on_a_loss_gap(tmp_path: Path) -> None:
    run = run_of("offload/optimizer=cpu_50", "verify.iters=4")
    base = RunResult.load(record_run(tmp_path / "b", [], LOSSES, peak=10.0))
    off = RunResult.load(record_run(tmp_path / "o", [], [*LOSSES[:3], 8.85], peak=7.0))
    report = compare(run, [], base, off, 3.0)
    assert not report.passed
    assert [c.name for c in report.criteria if not c.passed] == ["loss matches"]
    assert "**FAIL**" in render_markdown(report)


def test_verify_fails_without_a_memory_saving(tmp_path: Path) -> None:
    run = run_of("offload/optimizer=cpu_50", "verify.iters=4")
    base = RunResult.load(record_run(tmp_path / "b", [], LOSSES, peak=10.0))
    off = RunResult.load(record_run(tmp_path / "o", [], LOSSES, peak=10.5))
    failed = [c.name for c in compare(run, [], base, off, 3.0).criteria if not c.passed]
    assert failed == ["memory reduced"]


def test_verify_fails_when_a_run_did_not_finish(tmp_path: Path) -> None:
    run = run_of("offload/optimizer=cpu_50", "verify.iters=4")
    base = RunResult.load(record_run(tmp_path / "b", [], LOSSES, peak=10.0))
    off = RunResult.load(record_run(tmp_path / "o", [], None, peak=0, status="oom"))
    report = compare(run, [], base, off, 3.0)
    assert not report.passed and off.status == "oom"
    assert "oom, 0/4 iterations" in render_markdown(report)


def test_verify_reports_the_noise_floor_of_a_repeated_baseline(tmp_path: Path) -> None:
    run = run_of("offload/optimizer=cpu_50", "verify.iters=4")
    base = RunResult.load(record_run(tmp_path / "b", [], LOSSES, peak=10.0))
    again = RunResult.load(record_run(tmp_path / "r", [], [x + 5e-3 for x in LOSSES], peak=10.0))
    off = RunResult.load(record_run(tmp_path / "o", [], LOSSES, peak=7.0))
    report = compare(run, [], base, off, 3.0, repeat=again)
    assert report.noise_floor == pytest.approx(5e-3)
    assert "baseline vs its repeat" in render_markdown(report)


def test_verify_without_offload_is_a_usage_error(capsys, tmp_path: Path) -> None:
    assert main(["--recipe", "tiny", "--verify", f"output_dir={tmp_path / 'v'}"]) == EXIT_USAGE
    assert "nothing is offloaded" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_mode_flags_do_not_combine() -> None:
    with pytest.raises(Exception, match="can not be combined"):
        split_argv(["--plan", "--verify"])


def make_sweep(root: Path) -> Path:
    """A fraction sweep as Hydra multirun leaves it: job folders 0..4, the last one OOM."""
    fractions = ["0", "0.25", "0.5", "1.0", "0.75"]
    peaks = [20.0, 16.0, 12.0, 4.0, None]
    for job, (fraction, peak) in enumerate(zip(fractions, peaks, strict=True)):
        overrides = [
            "optimizer.optimizer_cpu_offload=true",
            f"optimizer.optimizer_offload_fraction={fraction}",
        ]
        record_run(
            root / str(job),
            overrides,
            LOSSES if peak else None,
            peak or 0.0,
            step_s=0.4 * (1 + float(fraction)),
            status="ok" if peak else "oom",
        )
    return root


def test_sweep_table_rows_reference_and_oom(tmp_path: Path) -> None:
    rows = collect(make_sweep(tmp_path))
    assert [r.value for r in rows] == ["0", "0.25", "0.5", "1.0", "0.75"]
    assert rows[0].label == "optimizer.optimizer_offload_fraction=0"  # the constant key is dropped
    assert rows[0].offload is False and rows[0].saved_gb is None  # the reference row
    assert rows[2].saved_gb == pytest.approx(8.0) and rows[2].slowdown == pytest.approx(1.5)
    assert rows[4].status == "oom" and rows[4].step_ms is None


def test_collect_writes_table_json_and_plot(tmp_path: Path, capsys) -> None:
    sweep = make_sweep(tmp_path / "sweep")
    assert main(["--collect", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "OOM" in out
    assert (
        "| optimizer.optimizer_offload_fraction=0.5 | ok | 600.0 | 1.50x |"
        in (sweep / "sweep.md").read_text()
    )
    assert len(json.loads((sweep / "sweep.json").read_text())) == 5
    png = (sweep / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_collect_of_an_empty_folder_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert collect_and_report(tmp_path) == 2
    assert "no run directories" in capsys.readouterr().err
