"""logger.tensorboard_dir / logger.wandb_project: rank 0 writes every step metric as a scalar."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import step_metrics

from offload_runner.config.schema import LoggerConfig
from offload_runner.metrics import MetricsReporter


def _step(i: int):
    return step_metrics(i, 10.0 - i)


def test_step_metrics_become_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    with MetricsReporter(
        tmp_path, 3, 0, True, LoggerConfig(tensorboard_dir=str(board))
    ) as reporter:
        for i in (1, 2, 3):
            reporter.record(_step(i))
    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "lm loss",
        "learning-rate",
        "grad-norm",
        "time/step_s",
        "throughput/tokens_per_s",
        "memory/gpu_peak_allocated_gb",
        "memory/host_pinned_gb",
    } <= tags
    assert [e.value for e in events.Scalars("lm loss")] == [9.0, 8.0, 7.0]
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3]


def test_only_the_writer_rank_writes(tmp_path: Path) -> None:
    board = tmp_path / "tb"
    with MetricsReporter(
        tmp_path, 1, 0, False, LoggerConfig(tensorboard_dir=str(board))
    ) as reporter:
        reporter.record(_step(1))
    assert not board.exists()


def test_wandb_offline_run_holds_the_step_metrics_and_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WANDB_MODE=offline: no network, the run lands under wandb_save_dir for `wandb sync`."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = LoggerConfig(wandb_project="offload-runner-test", wandb_save_dir=str(tmp_path / "wb"))
    with MetricsReporter(tmp_path, 3, 0, True, logger, {"model": {"num_layers": 2}}) as reporter:
        for i in (1, 2, 3):
            reporter.record(_step(i))
    reporter.write_summary({"world_size": 1})  # after the loop, as train() does
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    history = next(runs[0].glob("*.wandb")).read_bytes()
    assert b"lm loss" in history and b"time/step_s" in history
    assert b"num_layers" in history  # the resolved config travels with the run
