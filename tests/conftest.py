"""Shared helpers: compose a run config, run the CLI in-process or as a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload_runner.config.compose import compose_config, to_run_config
from offload_runner.config.schema import RunConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def compose_run(*overrides: str, extra_recipe_dirs: tuple[Path, ...] = ()) -> RunConfig:
    return to_run_config(compose_config(list(overrides), extra_recipe_dirs=extra_recipe_dirs))


# a library's warning, as Python's warnings module or Megatron-Core's loggers print one
LIBRARY_NOISE = re.compile(r"Warning\b|WARNING|DEPRECATED|site-packages/|warnings\.warn")


def run_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, prefix: tuple = ()
) -> subprocess.CompletedProcess[str]:
    """run_recipe.py as a user runs it: a fresh process, its exit code and its output
    (``prefix``: a command it runs under, e.g. AS_A_USER)."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(
        [*prefix, sys.executable, str(PROJECT_ROOT / "run_recipe.py"), *args],
        cwd=cwd or PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def as_a_user() -> tuple:
    """A prefix under which file permissions hold, as they do for a user: root (CI runs as root)
    without the capabilities that override them; skips where root has no setpriv."""
    import shutil

    if os.geteuid() != 0:
        return ()
    if not shutil.which("setpriv"):
        pytest.skip("root without setpriv: file permissions stop nothing here")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


SAMPLE = PROJECT_ROOT / "tests/data/sotu"  # six State of the Union addresses, public domain


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """The sample with a 4k byte-level BPE trained on it (0.1 s), 2 KB documents."""
    from offload_runner.cli import EXIT_OK, main

    prefix = tmp_path_factory.mktemp("prepared") / "sotu"
    args = ["--prepare", str(SAMPLE), "--output", str(prefix), "--vocab-size", "4096"]
    assert main([*args, "--chunk-kb", "2"]) == EXIT_OK
    return prefix


def step_metrics(iteration: int, loss: float):
    """A training step's metrics, with made-up timings and memory."""
    from offload_runner.metrics import StepMetrics

    return StepMetrics(
        iteration=iteration,
        loss=loss,
        lr=1e-4,
        grad_norm=1.5,
        step_time_s=0.5,
        tokens_per_s=1000.0,
        tflops_per_gpu=50.0,
        gpu_peak_allocated_gb=20.0,
        gpu_allocated_gb=10.0,
        host_pinned_gb=3.0,
    )


CHAT_SAMPLE = PROJECT_ROOT / "tests/data/chat/sotu_chat.jsonl"  # made by tools/make_chat_data.py
CHAT_TOKENIZER = PROJECT_ROOT / "tests/data/chat_tokenizer"  # a ChatML template, 4,096 ids


@pytest.fixture(scope="session")
def chat_prepared(tmp_path_factory) -> Path:
    """The chat sample's tokens and loss mask, through --prepare."""
    from offload_runner.cli import EXIT_OK, main

    prefix = tmp_path_factory.mktemp("chat") / "chat"
    args = ["--prepare", str(CHAT_SAMPLE), "--output", str(prefix)]
    assert main([*args, "--tokenizer", str(CHAT_TOKENIZER)]) == EXIT_OK
    return prefix
