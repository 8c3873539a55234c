#!/usr/bin/env python
"""What bounds the state pass with 8-bit moments (the whole Qwen3-30B-A3B's pass moved 31.8 GB/s
each way beside the forward, against 50.8 GB/s for bare copies both ways at once): one
``StatesWindow`` (offload/window.py) over N params of page-locked host state, the window of the
runs (512 MiB, WINDOW_PIECES slots), Transformer Engine's remainder Adam, bf16 gradients, as
state offload runs it at auto's 8-bit tier: the moments in 8 bits (through q8_triton.py's
kernels, and through the torch path), and in bf16.

    python bench/probes/state_pass_probe.py          # N=2G params by default (N=... to change)

Per case: the pass alone (paced as beside the forward, on its own thread), then beside a
stand-in forward (bf16 matmuls on the default stream), the median of 3; GB/s counts what
crosses the link each way. Then the torch profiler's top CUDA kernels of one 8-bit pass.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from offload_runner.hardware import WINDOW_SLOTS  # noqa: E402
from offload_runner.offload import quantized  # noqa: E402
from offload_runner.offload.host_adam import Piece  # noqa: E402
from offload_runner.offload.quantized import BLOCK  # noqa: E402
from offload_runner.offload.window import StatesWindow, te_adam  # noqa: E402

N = int(float(os.environ.get("N", str(2 * 1024**3))))
WINDOW = 512 * 1024**2
HYPERS = [dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)]
MOMENTS = {"q8": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}
# the cases: 8-bit moments through q8_triton.py's kernels and through the torch path, bf16 ones
CASES = (("q8", True), ("q8", False), ("bf16", True))


class Beside:
    """A stand-in for BesideForward: a side stream and one thread issuing the pass."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, initializer=torch.cuda.set_device, initargs=(0,)
        )

    def submit(self, fn, *args):
        return self._pool.submit(fn, *args)


def window_for(kind: str, param, grad) -> tuple[StatesWindow, list[Piece], int]:
    dtype = MOMENTS[kind]
    low = 0 if dtype == torch.float32 else 2 * dtype.itemsize
    piece = WINDOW // (WINDOW_SLOTS * (10 + low)) // BLOCK * BLOCK
    pin = dict(pin_memory=True)
    host = (
        torch.zeros(N, dtype=torch.int16, **pin),
        torch.zeros(N, dtype=dtype, **pin),
        torch.zeros(N, dtype=dtype, **pin),
    )
    scales = [None, *(torch.ones(N // BLOCK, **pin) for _ in range(2))] if kind == "q8" else []
    window = StatesWindow(host, torch.device("cuda"), piece, te_adam("cuda", True), scales=scales)
    pieces = [
        Piece(
            s,
            min(s + piece, N),
            grad[s : s + piece],
            param[s : s + piece],
            [(s, min(s + piece, N), 0)],
            block=s // BLOCK,
        )
        for s in range(0, N, piece)
    ]
    moved = 2 + (1 + 4 / BLOCK if kind == "q8" else dtype.itemsize) * 2  # B/param each way
    return window, pieces, moved


def one_pass(window, pieces, step: int, beside: Beside) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    marks = window.run(pieces, step, HYPERS, beside=beside)
    for mark in marks:
        mark.ready.wait()
    window._job.result()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def busy(stop: threading.Event) -> None:
    """The stand-in forward: 8k x 8k bf16 matmuls on the default stream until ``stop``."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def main() -> None:
    param = torch.zeros(N, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn(N, dtype=torch.bfloat16, device="cuda") * 1e-3
    beside = Beside()
    fused = quantized._fused
    for kind, triton in CASES:
        quantized._fused = fused if triton else lambda: None  # the torch path, for comparison
        window, pieces, moved = window_for(kind, param, grad)
        one_pass(window, pieces, 1, beside)  # warm-up
        alone = [one_pass(window, pieces, 2 + i, beside) for i in range(3)]
        stop = threading.Event()
        load = threading.Thread(target=busy, args=(stop,))
        load.start()
        time.sleep(0.5)
        loaded = [one_pass(window, pieces, 5 + i, beside) for i in range(3)]
        stop.set()
        load.join()
        for name, times in (("alone", alone), ("beside matmuls", loaded)):
            s = statistics.median(times)
            print(
                f"{kind}{'' if triton else ' (torch path)'} {name}: {s:.3f} s for "
                f"{N / 1e9:.2f}G params, "
                f"{N * moved / s / 1e9:.1f} GB/s each way, {len(pieces)} pieces of "
                f"{pieces[0].numel / 1e6:.1f}M"
            )
        if kind == "q8" and triton:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                one_pass(window, pieces, 9, beside)
            print(
                prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=18, max_name_column_width=70
                )
            )
        del window
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
