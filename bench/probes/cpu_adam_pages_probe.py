#!/usr/bin/env python
"""Two things that could take fused CPU AdamW's rate inside the engine, outside the engine:

1. the host pages: torch's own allocation (the bench's reference) against the engine's arenas
   (an anonymous mapping, ``cudaHostRegister``-ed where DMA touches it), with and without
   transparent huge pages (``MADV_HUGEPAGE``), one call over the whole arrays and in the
   engine's 64 MiB pieces;
2. the GIL: the pieces updated on a worker thread while the main thread is idle, launches small
   CUDA kernels without pause (a training thread), or spins in pure Python; one fused call per
   piece against one call per 8 pieces.

    # one GPU; N=5e8, THREADS=16
    OMP_WAIT_POLICY=PASSIVE python bench/probes/cpu_adam_pages_probe.py

Prints the host's transparent-huge-page settings, then one line per case: seconds and rate of
the Adam calls against the reference. Needs CUDA for the registered cases and the launching
thread.
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from pathlib import Path

import torch

N = int(float(os.environ.get("N", "5e8")))
PIECE = 16 * 1024**2  # the engine's 64 MiB pieces of fp32
HYPER = dict(
    lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False
)
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def arena(n: int, huge: bool, pin: bool, keep: list) -> torch.Tensor:
    """n fp32 on an anonymous mapping of their own (the engine's arenas), huge pages advised
    where told, registered with CUDA where told."""
    nbytes = n * 4
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        region.madvise(MADV_HUGEPAGE)
    t = torch.frombuffer(region, dtype=torch.float32, count=n)
    t.zero_()  # fault the pages in (as huge pages where advised and granted)
    if pin:
        assert int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)) == 0
    keep.append(region)
    return t


def arrays(kind: str, keep: list) -> list[torch.Tensor]:
    """master, grad, exp_avg, exp_avg_sq of N params, allocated as ``kind`` says."""
    if kind == "torch.empty":
        out = [torch.zeros(N) for _ in range(4)]
    elif kind == "pin_memory":
        out = [torch.zeros(N, pin_memory=True) for _ in range(4)]
    else:
        huge, pin = "huge" in kind, "registered" in kind
        out = [arena(N, huge, pin, keep) for _ in range(4)]
    out[0].normal_(0, 0.02)
    out[1].normal_(0, 1e-3)
    return out


def anon_huge_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024**2
    return 0.0


def adam(a: list[torch.Tensor], lo: int, hi: int, step: torch.Tensor) -> None:
    torch._fused_adamw_(
        [a[0][lo:hi]], [a[1][lo:hi]], [a[2][lo:hi]], [a[3][lo:hi]], [], [step], **HYPER
    )


def adam_batched(a: list[torch.Tensor], spans: list[tuple[int, int]], step) -> None:
    """One fused call over several pieces (lists of views: one GIL hand-off for them all)."""
    lists = [[x[lo:hi] for lo, hi in spans] for x in a]
    torch._fused_adamw_(*lists, [], [step] * len(spans), **HYPER)


def timed(fn, repeats: int = 4) -> float:
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])  # the first warms up


def pieces(a: list[torch.Tensor], step, per_call: int) -> None:
    spans = [(s, min(s + PIECE, N)) for s in range(0, N, PIECE)]
    for i in range(0, len(spans), per_call):
        batch = spans[i : i + per_call]
        if per_call == 1:
            adam(a, *batch[0], step)
        else:
            adam_batched(a, batch, step)


def with_main_thread(work, main: str) -> float:
    """Seconds of ``work`` on a worker thread while the main thread does ``main``."""
    out: list[float] = []

    def worker() -> None:
        out.append(timed(work))

    thread = threading.Thread(target=worker)
    thread.start()
    if main == "launching":
        x = torch.zeros(1024, device="cuda")
        while thread.is_alive():
            for _ in range(64):
                x.add_(1.0)  # a small kernel: the GIL is released and taken again per launch
            torch.cuda.synchronize()
    elif main == "spinning":
        n = 0
        while thread.is_alive():
            n += 1
    thread.join()
    return out[0]


def main() -> None:
    threads = int(os.environ.get("THREADS", "16"))
    torch.set_num_threads(threads)
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    settings = {
        f.name: f.read_text().strip() for f in (thp / "enabled", thp / "defrag") if f.exists()
    }
    print(
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"N={N:.3g} params, {threads} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', '')}, transparent_hugepage {settings}"
    )
    step = torch.tensor(10.0)
    reference = None
    kinds = (
        "torch.empty",
        "arena",
        "arena, huge pages",
        "arena, registered",
        "arena, huge pages, registered",
        "pin_memory",
    )
    for kind in kinds:
        reference = measure(kind, step, reference)


def line(what: str, seconds: float, reference: float, extra: str = "") -> None:
    print(
        f"{what}: {seconds * 1000:6.1f} ms = {N / seconds / 1e9:.2f} G params/s, "
        f"{reference / seconds:.2f}x the reference{extra}"
    )


def measure(kind: str, step: torch.Tensor, reference: float | None) -> float:
    """Every case on arrays allocated as ``kind`` says; returns the reference's seconds (the
    first case measured)."""
    keep: list = []
    before = anon_huge_gb()
    a = arrays(kind, keep)
    huge = f" (huge pages {anon_huge_gb() - before:.1f} GB)"
    for name, fn in (
        ("one call", lambda: adam(a, 0, N, step)),
        ("pieces", lambda: pieces(a, step, 1)),
    ):
        seconds = timed(fn)
        reference = reference or seconds
        line(f"{kind}, {name}", seconds, reference, huge)
    if kind == "arena, registered":
        for main_thread in ("idle", "launching", "spinning"):
            for per_call in (1, 8):
                seconds = with_main_thread(lambda p=per_call: pieces(a, step, p), main_thread)
                line(
                    f"{kind}, pieces on a worker, main thread {main_thread}, {per_call} "
                    "piece(s) per call",
                    seconds,
                    reference,
                )
    if "registered" in kind:
        for t in a:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    return reference


if __name__ == "__main__":
    main()
