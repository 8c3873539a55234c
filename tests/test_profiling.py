"""profiling.*: the PyTorch profiler window writes a trace, a table of ops and its summary."""

from __future__ import annotations

import gzip
import json

import torch

from offload_runner.config.schema import ProfilingConfig
from offload_runner.profiling import IterationProfiler
from offload_runner.trace_summary import summarize


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
    summary = (tmp_path / "profile/rank0-summary.txt").read_text().splitlines()
    assert summary[1].startswith("window ") and "kernels busy 0.0 ms (0%)" in summary[1]
    assert "aten::mm" in "\n".join(summary)


def test_the_summary_sets_kernel_time_against_the_window_and_each_micro_batch(tmp_path):
    """Two micro-batches (each from a forward's embedding lookup) over a 10 ms window; kernels
    overlapping on two streams count once."""

    def event(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}

    events = [
        event("cpu_op", "aten::embedding", 0, 100),
        event("kernel", "gemm", 1000, 2000, stream=7),
        event("kernel", "gemm", 2000, 1000, stream=8),  # inside the first: busy once
        event("cpu_op", "aten::embedding", 5000, 100),
        event("kernel", "adam", 6000, 1000, stream=7),
        event("cuda_runtime", "cudaLaunchKernel", 9000, 1000),
    ]
    trace = tmp_path / "rank0.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    lines = summarize(trace).splitlines()
    assert lines[1] == "window 10.0 ms, kernels busy 3.0 ms (30%), 3 kernels, copies 0.0 ms"
    text = "\n".join(lines)
    assert "gemm" in text and "cudaLaunchKernel" in text
    at = lines.index(next(x for x in lines if x.startswith("-- micro-batches")))
    assert [x.split() for x in lines[at + 1 : at + 3]] == [["0", "5.0", "2.0"], ["1", "5.0", "1.0"]]


def test_other_ranks_and_disabled_write_nothing(tmp_path):
    cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=1, profile_step_end=1)
    for profiler in (
        IterationProfiler(cfg, tmp_path, rank=1),
        IterationProfiler(ProfilingConfig(), tmp_path, rank=0),
    ):
        profiler.begin(1)
        profiler.end(1)
    assert not (tmp_path / "profile").exists()
