"""``profiling.*``: profile a window of iterations with the PyTorch profiler or for Nsight Systems.

The PyTorch profiler writes a trace (open it in Perfetto or chrome://tracing), a table of ops by
GPU and CPU time and the trace's summary (``trace_summary``: GPU busy against the window, the
kernels, runtime calls and micro-batches that take the time) into ``<run_dir>/profile/``. The
Nsight mode brackets the window with cudaProfilerStart/Stop, so ``nsys profile
--capture-range=cudaProfilerApi`` records only it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from offload_runner.config.schema import ProfilingConfig

log = logging.getLogger(__name__)


class IterationProfiler:
    """Call ``begin(iteration)`` before and ``end(iteration)`` after each training iteration."""

    def __init__(self, cfg: ProfilingConfig, run_dir: Path, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.out = run_dir / "profile"
        self.active = rank in cfg.profile_ranks and (
            cfg.use_pytorch_profiler or cfg.use_nsys_profiler
        )
        self._torch_profiler = None

    def begin(self, iteration: int) -> None:
        if not self.active or iteration != self.cfg.profile_step_start:
            return
        import torch

        if self.cfg.use_nsys_profiler:
            torch.cuda.profiler.start()
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch_profiler = torch.profiler.profile(
                activities=activities, record_shapes=self.cfg.record_shapes
            )
            self._torch_profiler.__enter__()
        log.info("profiling iterations %d..%d", iteration, self.cfg.profile_step_end)

    def end(self, iteration: int) -> None:
        if not self.active or iteration != self.cfg.profile_step_end:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self.cfg.use_nsys_profiler:
            torch.cuda.profiler.stop()
            return
        prof, self._torch_profiler = self._torch_profiler, None
        if prof is None:  # the window began before a resumed run's first iteration
            return
        prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"rank{self.rank}.json.gz"
        prof.export_chrome_trace(str(trace))
        table = prof.key_averages().table
        (self.out / f"rank{self.rank}-ops.txt").write_text(
            "by GPU time\n"
            + table(sort_by="self_device_time_total", row_limit=60)
            + "\n\nby CPU time\n"
            + table(sort_by="self_cpu_time_total", row_limit=60)
            + "\n"
        )
        from offload_runner import trace_summary

        summary = trace_summary.summarize(trace)
        (self.out / f"rank{self.rank}-summary.txt").write_text(summary + "\n")
        log.info("profile written: %s; %s", trace, summary.splitlines()[1])

    def close(self) -> None:
        """Stop a window the run did not reach the end of (no files are written)."""
        if self._torch_profiler is not None:
            self._torch_profiler.__exit__(None, None, None)
            self._torch_profiler = None
