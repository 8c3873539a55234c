#!/usr/bin/env python
"""Does a small copy of the training's stream wait behind another stream's copies?

State offload's pass beside the next forward keeps both copy directions busy from a thread of
its own, a few pieces queued ahead at a time; the forward meanwhile copies its batch up and, in
each MoE layer, its tokens per expert down (then waits for them). This probe does the same
without the model, on one GPU: a thread copies CHUNK-sized pieces up and down on two side
streams, at most DEPTH queued per direction, while the main thread, every 20 ms, copies a batch
up (four 32 KiB tensors) and a 4-byte value down and waits for each. It prints, per chunk size
and depth, the small copies' latency (median and largest) and what the side traffic moved:

    python bench/probes/copy_queue_probe.py \
        [--runs 0x0,128x4,128x4k,16x4,16x4k,2x4k,128x1] [--seconds 4]

Run 0x0 is no side traffic (the small copies' own latency). If the small copies wait about
DEPTH chunks' time, the copy engines take the streams' copies in order; if they wait far longer,
a stream that keeps its queue full holds them off. A trailing k puts a one-element kernel after
each side copy (what the state window does: does the engine yield there?); a depth of 1 empties
the queue between chunks; both show what the gap costs the side traffic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

LINK_MB = 1024  # the side traffic's buffers each way


def side_traffic(
    chunk_mb: int,
    depth: int,
    gaps: bool,
    stop: threading.Event,
    started: threading.Event,
    moved: list,
) -> None:
    """Copies of ``chunk_mb`` MiB up and down, paced: a direction's next copy waits until the
    copy ``depth`` before it has finished (4: the pass's window of four slots); with ``gaps``, a
    one-element kernel on the copy's stream after each (as the state window issues them).
    ``started`` is set once the first copies are queued; ``moved`` gets (bytes each way,
    seconds)."""
    n = chunk_mb * 2**20 // 4
    slots = LINK_MB // chunk_mb
    host = [torch.empty(slots * n, dtype=torch.float32).pin_memory() for _ in range(2)]
    device = [torch.empty(slots * n, dtype=torch.float32, device="cuda") for _ in range(2)]
    tick = [torch.zeros(1, device="cuda") for _ in range(2)]
    up, down = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)
    pending: list = []
    i, began = 0, time.perf_counter()
    while not stop.is_set():
        view = slice(i % slots * n, (i % slots + 1) * n)
        done = []
        for k, (stream, dst, src) in enumerate(
            ((up, device[0], host[0]), (down, host[1], device[1]))
        ):
            with torch.cuda.stream(stream):
                dst[view].copy_(src[view], non_blocking=True)
                if gaps:
                    tick[k].neg_()
                done.append(torch.cuda.Event())
                done[-1].record(stream)
        pending.append(done)
        started.set()
        if len(pending) >= depth:
            for event in pending.pop(0):
                event.synchronize()
        i += 1
    for events in pending:
        for event in events:
            event.synchronize()
    moved.append((i * chunk_mb * 2**20, time.perf_counter() - began))


def _waited(stream: torch.cuda.Stream, limit_s: float) -> float:
    """Ms until ``stream``'s work so far is done, polled; ``inf`` past ``limit_s`` (starved: a
    wait that never ends while the side stream keeps its queue fed)."""
    done = torch.cuda.Event()
    done.record(stream)
    began = time.perf_counter()
    while not done.query():
        if time.perf_counter() - began > limit_s:
            return float("inf")
        time.sleep(50e-6)
    return (time.perf_counter() - began) * 1e3


def small_copies(seconds: float, limit_s: float) -> tuple[list[float], list[float]]:
    """Every 20 ms: a batch up, then a 4-byte value down, each waited for; their latencies in
    ms. Stops at the first copy still waiting after ``limit_s`` (its latency ``inf``)."""
    batch = [torch.zeros(4096, dtype=torch.int64).pin_memory() for _ in range(4)]
    value, landed = torch.ones(1, device="cuda"), torch.empty(1).pin_memory()
    stream = torch.cuda.current_stream()
    ups, downs = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        on_gpu = [t.cuda(non_blocking=True) for t in batch]
        ups.append(_waited(stream, limit_s))
        landed.copy_(value, non_blocking=True)
        downs.append(_waited(stream, limit_s))
        del on_gpu
        if float("inf") in ups[-1:] + downs[-1:]:
            break
        time.sleep(0.02)
    return ups, downs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs",
        default="0x0,128x4,128x4k,16x4,16x4k,2x4k,128x1",
        help="CHUNK_MiBxDEPTH[k], comma-separated (k: a kernel after each copy)",
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument(
        "--limit",
        type=float,
        default=2.0,
        help="seconds a small copy may wait before it counts as starved",
    )
    args = parser.parse_args()
    torch.cuda.init()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{time.strftime('%Y-%m-%d')}, CUDA_DEVICE_MAX_CONNECTIONS="
        f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}"
    )
    print(
        "chunk MiB x depth | batch up ms (median / max) | 4 B down ms (median / max) | "
        "side GB/s each way"
    )
    for run in args.runs.split(","):
        chunk_mb, depth = (int(x) for x in run.rstrip("k").split("x"))
        stop, started, moved = threading.Event(), threading.Event(), []
        thread = None
        if chunk_mb:
            thread = threading.Thread(
                target=side_traffic, args=(chunk_mb, depth, run.endswith("k"), stop, started, moved)
            )
            thread.start()
            started.wait()
            time.sleep(0.2)  # under way
        ups, downs = small_copies(args.seconds, args.limit)
        stop.set()
        if thread is not None:
            thread.join()
        rate = moved[0][0] / moved[0][1] / 1e9 if moved else 0.0
        print(
            f"{run:>17} | {statistics.median(ups):7.2f} / {max(ups):7.2f} | "
            f"{statistics.median(downs):7.2f} / {max(downs):7.2f} | {rate:.1f}"
            + (
                f"  (starved: a copy waited over {args.limit:g} s)"
                if float("inf") in ups + downs
                else ""
            )
        )


if __name__ == "__main__":
    main()
