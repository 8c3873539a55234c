#!/usr/bin/env python
"""What the host engines' start-up spends on their host arrays: page-locking fresh pages.

The engines allocate each host array as an anonymous mapping (``host_memory.HostArenas``) and
page-lock it with ``cudaHostRegister``, which faults in every page it has not seen, one 4 KiB
page at a time on one thread. This times, for ``GB`` of arrays in ``ARRAYS`` pieces:

- register untouched: register first, then ``zero_()`` (what the engines do today);
- zero, then register: ``zero_()`` first, on torch's intra-op threads, then register;
- the same two with transparent huge pages advised (``MADV_HUGEPAGE``);

and, for each, a 1 GiB copy from the GPU into the array (the DMA the engine relies on).

    GB=8 python bench/probes/host_pinning_probe.py     # one GPU

Prints one line per case: seconds to map, fault, register and zero, the total's rate, the
huge pages granted and the copy's rate.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import torch

GB = float(os.environ.get("GB", "8"))
ARRAYS = int(os.environ.get("ARRAYS", "4"))
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def anon_huge_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024**2
    return 0.0


def one_case(huge: bool, zero_first: bool) -> dict:
    nbytes = int(GB * 1e9 / ARRAYS) // 4096 * 4096
    times = dict(map=0.0, zero=0.0, register=0.0)
    huge_before, kept = anon_huge_gb(), []
    for _ in range(ARRAYS):
        t0 = time.perf_counter()
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            region.madvise(MADV_HUGEPAGE)
        arr = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)
        times["map"] += time.perf_counter() - t0
        steps = ("zero", "register") if zero_first else ("register", "zero")
        for step in steps:
            t0 = time.perf_counter()
            if step == "zero":
                arr.zero_()
            else:
                status = torch.cuda.cudart().cudaHostRegister(arr.data_ptr(), nbytes, 0)
                assert int(status) == 0, status
            times[step] += time.perf_counter() - t0
        kept.append((region, arr))
    huge_gb = anon_huge_gb() - huge_before
    src = torch.ones(2**30, dtype=torch.uint8, device="cuda")
    dst = kept[0][1][: 2**30]
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    copy_gbs = 4 * 2**30 / (time.perf_counter() - t0) / 1e9
    for region, arr in kept:
        torch.cuda.cudart().cudaHostUnregister(arr.data_ptr())
        del arr
        region.close()
    total = sum(times.values())
    return dict(
        times, total=total, rate=nbytes * ARRAYS / total / 1e9, huge_gb=huge_gb, copy_gbs=copy_gbs
    )


def main() -> None:
    torch.cuda.init()
    thp = {
        k: Path(f"/sys/kernel/mm/transparent_hugepage/{k}").read_text().strip()
        for k in ("enabled", "defrag")
    }
    print(
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{GB:g} GB in {ARRAYS} arrays, {torch.get_num_threads()} intra-op threads, "
        f"transparent_hugepage {thp}"
    )
    for huge in (False, True):
        for zero_first in (False, True):
            r = one_case(huge, zero_first)
            name = ("huge pages, " if huge else "") + (
                "zero, then register" if zero_first else "register untouched, then zero"
            )
            print(
                f"{name:45s} map {r['map']:.2f} s, zero {r['zero']:.2f} s, register "
                f"{r['register']:.2f} s: {r['total']:.2f} s = {r['rate']:.1f} GB/s; huge "
                f"pages {r['huge_gb']:.1f} GB; GPU-to-host copy {r['copy_gbs']:.1f} GB/s"
            )


if __name__ == "__main__":
    main()
