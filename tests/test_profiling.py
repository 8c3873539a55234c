"""profiling.*: the PyTorch profiler window writes a trace and a table of ops."""

from __future__ import annotations

import gzip
import json

import torch

from offload_runner.config.schema import ProfilingConfig
from offload_runner.profiling import IterationProfiler


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
    for profiler in (
        IterationProfiler(cfg, tmp_path, rank=1),
        IterationProfiler(ProfilingConfig(), tmp_path, rank=0),
    ):
        profiler.begin(1)
        profiler.end(1)
    assert not (tmp_path / "profile").exists()
