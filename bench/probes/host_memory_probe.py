#!/usr/bin/env python
"""How much the host's memory moves per second, and how the CPU and the link's copies share it:
what bounds exact CPU Adam with a GPU share, whose two parts both live in host memory.

Each case runs for ``SECONDS`` on all of torch's intra-op threads:

- CPU copy: ``copy_`` between two 2 GiB fp32 arrays (bytes read + written);
- CPU Adam: ``torch._fused_adamw_`` on 256M fp32 params (28 B/param read + written);
- the link: 1 GiB page-locked copies up and down at once, on two streams (bytes each way);
- each CPU case again while the link runs; and the copy alone at a quarter and half the threads
  (a rate that stops growing with threads is the memory's, not the cores').

    OMP_WAIT_POLICY=PASSIVE python bench/probes/host_memory_probe.py     # one GPU

Prints one line per case, then the host memory's traffic (CPU + both link directions) alone
and beside each other.
"""

from __future__ import annotations

import os
import threading
import time

import torch

SECONDS = float(os.environ.get("SECONDS_PER_CASE", "4"))
COPY_NUMEL = 512 * 1024**2  # 2 GiB of fp32, far past the caches
ADAM_NUMEL = 256 * 1024**2
LINK_BYTES = 1024**3
ADAM_BYTES_PER_PARAM = 28  # param, grad, exp_avg, exp_avg_sq read; param and both moments written
HYPER = dict(
    lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False
)


def cpu_copy() -> tuple[callable, int]:
    src, dst = torch.rand(COPY_NUMEL), torch.empty(COPY_NUMEL)
    return (lambda: dst.copy_(src)), 2 * 4 * COPY_NUMEL


def cpu_adam() -> tuple[callable, int]:
    p, g = torch.rand(ADAM_NUMEL), torch.rand(ADAM_NUMEL) * 1e-3
    m, v, step = torch.zeros(ADAM_NUMEL), torch.zeros(ADAM_NUMEL), torch.tensor(10.0)
    return (lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step], **HYPER)), (
        ADAM_BYTES_PER_PARAM * ADAM_NUMEL
    )


def timed(op, nbytes: int, stop: threading.Event | None = None) -> float:
    """Bytes per second of ``op`` run for SECONDS (after one warm-up call)."""
    op()
    began, calls = time.perf_counter(), 0
    while time.perf_counter() - began < SECONDS:
        op()
        calls += 1
    return calls * nbytes / (time.perf_counter() - began)


class Link:
    """Copies up and down at once until stopped; ``rate`` is bytes per second each way."""

    def __init__(self) -> None:
        self.host_up = torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=True)
        self.host_down = torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=True)
        self.dev_up = torch.empty(LINK_BYTES, dtype=torch.uint8, device="cuda")
        self.dev_down = torch.empty(LINK_BYTES, dtype=torch.uint8, device="cuda")
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream())
        self.stop, self.rate = threading.Event(), 0.0

    def run(self) -> None:
        began, rounds = time.perf_counter(), 0
        while not self.stop.is_set():
            with torch.cuda.stream(self.streams[0]):
                self.dev_up.copy_(self.host_up, non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.host_down.copy_(self.dev_down, non_blocking=True)
            for s in self.streams:
                s.synchronize()
            rounds += 1
        self.rate = rounds * LINK_BYTES / (time.perf_counter() - began)

    def beside(self, op=None, nbytes: int = 0) -> float:
        """The CPU op's bytes per second while the link runs (the link alone without one)."""
        self.stop.clear()
        thread = threading.Thread(target=self.run)
        thread.start()
        rate = timed(op, nbytes) if op else (time.sleep(SECONDS) or 0.0)
        self.stop.set()
        thread.join()
        return rate


def main() -> None:
    print(
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}, {SECONDS:.0f} s a case"
    )
    op, nbytes = cpu_copy()
    threads, rates = torch.get_num_threads(), []
    for n in sorted({max(1, threads // 4), max(1, threads // 2), threads}):
        torch.set_num_threads(n)
        rates.append(f"{n} threads {timed(op, nbytes) / 1e9:.1f}")
    torch.set_num_threads(threads)
    print("CPU copy alone, GB/s read + written: " + ", ".join(rates))
    del op
    link = Link()
    link.beside()
    link_alone = link.rate
    print(
        f"link alone: {link_alone / 1e9:.1f} GB/s each way "
        f"(host memory {2 * link_alone / 1e9:.1f} GB/s)"
    )
    for name, make in (("CPU copy", cpu_copy), ("CPU Adam", cpu_adam)):
        op, nbytes = make()
        alone = timed(op, nbytes)
        beside = link.beside(op, nbytes)
        print(
            f"{name}: alone {alone / 1e9:.1f} GB/s; beside the link {beside / 1e9:.1f} GB/s "
            f"({beside / alone:.2f}x), the link then {link.rate / 1e9:.1f} GB/s each way "
            f"({link.rate / link_alone:.2f}x); host memory together "
            f"{(beside + 2 * link.rate) / 1e9:.1f} GB/s"
        )
        if name == "CPU Adam":
            per_param = ADAM_BYTES_PER_PARAM * 1e9
            print(
                f"CPU Adam: {alone / per_param:.2f} G params/s alone, "
                f"{beside / per_param:.2f} beside the link"
            )
        del op


if __name__ == "__main__":
    main()
