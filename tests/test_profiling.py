"""profiling.*: the PyTorch profiler writes a trace and an ops table; rules refuse bad windows."""

from __future__ import annotations

import gzip
import json

import torch

from offload_runner.config.schema import ProfilingConfig, RunConfig
from offload_runner.profiling import IterationProfiler
from offload_runner.validation import Environment, check_rules


def test_window_writes_trace_and_table(tmp_path):
    cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=3)
    profiler = IterationProfiler(cfg, tmp_path, rank=0)
    x = torch.randn(64, 64)
    for iteration in range(1, 5):
        profiler.begin(iteration)
        x = (x @ x).tanh()
        profiler.end(iteration)
    trace = json.loads(gzip.decompress((tmp_path / "profile/rank0.json.gz").read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names
    assert "aten::mm" in (tmp_path / "profile/rank0-ops.txt").read_text()


def test_other_ranks_and_disabled_write_nothing(tmp_path):
    cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=1, profile_step_end=1)
    for profiler in (IterationProfiler(cfg, tmp_path, rank=1),
                     IterationProfiler(ProfilingConfig(), tmp_path, rank=0)):  # fmt: skip
        profiler.begin(1)
        profiler.end(1)
    assert not (tmp_path / "profile").exists()


def _rules(**profiling) -> set[str]:
    run = RunConfig()
    for key, value in profiling.items():
        setattr(run.profiling, key, value)
    return {v.rule for v in check_rules(run, Environment(te_available=True))}


def test_profiling_rules():
    assert not _rules(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=3)
    assert "profile_window" in _rules(use_pytorch_profiler=True, profile_step_start=5,
                                      profile_step_end=4)  # fmt: skip
    assert "profile_window_after_end" in _rules(use_nsys_profiler=True, profile_step_start=50,
                                                profile_step_end=60)  # fmt: skip
    assert "profile_one_tool" in _rules(use_pytorch_profiler=True, use_nsys_profiler=True)
    assert not _rules(profile_step_start=50, profile_step_end=1)  # off: the window is not checked
