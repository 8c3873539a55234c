"""validation.eval_iters: the loss on the held-out split, beside the training loss (the GPU
path itself: tests/test_gpu_training.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import compose_run, step_metrics

from offload_runner.cli import EXIT_USAGE, main
from offload_runner.config.schema import LoggerConfig
from offload_runner.mcore.data import build_datasets, validation_documents
from offload_runner.metrics import MetricsReporter
from offload_runner.prepare import read_metadata
from offload_runner.train import evaluates_at


def _indexed(prefix: Path, *overrides: str):
    return compose_run(
        "recipe=tiny",
        "data=indexed",
        f"dataset.data_path=[{prefix}]",
        "model.vocab_size=4096",
        "dataset.num_workers=0",
        "train.train_iters=4",
        *overrides,
    )


@pytest.mark.filterwarnings("ignore")
def test_evaluation_reads_held_out_documents_of_the_prepared_text(prepared: Path) -> None:
    run = _indexed(prepared, "validation.eval_iters=2")
    train, validation = build_datasets(run)
    documents = read_metadata(prepared)["documents"]
    assert validation_documents(run) == round(documents) - round(documents * 0.99) > 0
    assert len(validation) >= 2 * run.train.global_batch_size
    assert not set(validation.indices.tolist()) & set(train.indices.tolist())  # held out
    off = _indexed(prepared, "validation.eval_iters=0")
    assert build_datasets(off)[1] is None  # no evaluation: no validation split built


def test_real_text_is_evaluated_unless_weight_offload_streams() -> None:
    """data=indexed evaluates 10 global batches after the last iteration by default; weight
    offload (which can not) turns that default off rather than refusing the run, while an
    explicit validation.eval_iters beside it is still refused."""
    text = ("recipe=tiny", "data=indexed", "dataset.data_path=[/data/text]")
    assert compose_run(*text).validation.eval_iters == 10
    assert not compose_run("recipe=tiny").validation.eval_iters  # mock data: nothing held out
    weights = ("offload/weight=enabled", "offload/optimizer=states")
    assert compose_run(*text, *weights).validation.eval_iters == 0


def test_evaluations_follow_the_interval_and_the_last_iteration() -> None:
    run = compose_run("recipe=tiny", "train.train_iters=10", "validation.eval_iters=2")
    assert [i for i in range(1, 11) if evaluates_at(run, i)] == [10]
    run = compose_run(
        "recipe=tiny",
        "train.train_iters=10",
        "validation.eval_iters=2",
        "validation.eval_interval=4",
    )
    assert [i for i in range(1, 11) if evaluates_at(run, i)] == [4, 8, 10]
    off = compose_run("recipe=tiny")
    assert not any(evaluates_at(off, i) for i in range(1, 100))


def test_the_validation_curve_lands_in_metrics_and_summary(tmp_path: Path) -> None:
    with MetricsReporter(tmp_path, 2, 0, True, LoggerConfig()) as reporter:
        for i in (1, 2):
            reporter.record(step_metrics(i, 9.0 - i))
            reporter.record_validation(i, 8.5 - i)
        summary = reporter.write_summary({})
    assert summary["final_validation_loss"] == 6.5
    assert 0 <= time.time() - summary["summary_written_at"] < 60
    assert summary["validation_losses"] == [[1, 7.5], [2, 6.5]]
    assert summary["losses"] == [8.0, 7.0]  # the training curve keeps its own
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["validation_loss"] for x in lines if "validation_loss" in x] == [7.5, 6.5]
    assert json.loads((tmp_path / "summary.json").read_text())["final_validation_loss"] == 6.5


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("dataset.split='100,0,0'",), "gives it no document"),
        (("offload/weight=enabled", "offload/optimizer=states"), "weight offload's ring"),
    ],
    ids=["no-validation-split", "weight-offload"],
)
def test_evaluation_that_cannot_run_is_refused(prepared, tmp_path, capsys, overrides, says) -> None:
    args = [
        "--recipe",
        "tiny",
        "data=indexed",
        f"dataset.data_path=[{prepared}]",
        "model.vocab_size=4096",
        "validation.eval_iters=2",
        *overrides,
        f"output_dir={tmp_path}/run",
        "--dry-run",
    ]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert says in err and "fix:" in err
    assert not (tmp_path / "run").exists()
