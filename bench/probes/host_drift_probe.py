#!/usr/bin/env python
"""How much the host alone drifts: the rate at which one thread launches small CUDA kernels
(what bounds the proxy's forward and backward at micro-batch 1) and a pure-Python loop, timed
again and again with nothing else running.

    SECONDS_TOTAL=240 python bench/probes/host_drift_probe.py     # one GPU

Prints one line per round (every ``EVERY`` s): the launches' and the loop's time and the share
of the CPUs' time the hypervisor gave to others meanwhile (``steal`` in /proc/stat), and at the
end each one's range over the rounds (max / min).
"""

from __future__ import annotations

import os
import time

import torch

TOTAL = float(os.environ.get("SECONDS_TOTAL", "240"))
EVERY = float(os.environ.get("EVERY", "10"))
LAUNCHES = 20_000


def launches(x: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(LAUNCHES):
        x.add_(1.0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def steal() -> tuple[int, int]:
    """The CPUs' stolen and total jiffies so far (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[7], sum(fields[:8])


def python_loop() -> float:
    t0 = time.perf_counter()
    total = 0
    for i in range(2_000_000):
        total += i & 7
    return time.perf_counter() - t0


def main() -> None:
    x = torch.zeros(1024, device="cuda")
    launches(x)
    print(
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}: "
        f"{LAUNCHES} launches of a 1024-element add, and a 2e6-step Python loop, every "
        f"{EVERY:g} s for {TOTAL:g} s"
    )
    rounds, began = [], time.perf_counter()
    while time.perf_counter() - began < TOTAL:
        start, (stolen, total) = time.perf_counter(), steal()
        row = (start - began, launches(x), python_loop())
        stolen2, total2 = steal()
        rounds.append(row)
        print(
            f"t {row[0]:6.1f} s  launches {row[1] * 1e6 / LAUNCHES:5.2f} us each  "
            f"python loop {row[2] * 1e3:6.1f} ms  steal "
            f"{100 * (stolen2 - stolen) / max(1, total2 - total):4.1f}%",
            flush=True,
        )
        time.sleep(max(0.0, EVERY - (time.perf_counter() - start)))
    for name, i in (("launches", 1), ("python loop", 2)):
        values = [r[i] for r in rounds]
        print(
            f"{name}: {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f} ms over {len(values)} "
            f"rounds, max/min {max(values) / min(values):.2f}x"
        )


if __name__ == "__main__":
    main()
