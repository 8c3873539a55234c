"""A profiling.use_pytorch_profiler trace summarized: GPU busy vs idle, kernels and runtime calls.
A profiled run writes it beside its trace (``profile/rankN-summary.txt``); for a trace at hand:

    python -m offload_runner.trace_summary RUN_DIR/profile/rank0.json.gz [...]

Prints, per trace: the window's wall span, the union of kernel time (GPU busy), the idle rest,
the kernels and CUDA runtime calls that take the most time, and the Python-side ops by self time;
then each micro-batch (from one forward's embedding lookup to the next, the last to the window's
end): its host span and the GPU's busy time in it, so a slowdown shows where it sits in the step;
then the annotations and where the forward's thread (and each other busy thread) sat idle outside
CUDA, where a lock, an event or the interpreter held it; the copies that waited longest for the
copy engines (another stream's queue of copies ahead of them); then the runtime calls
by thread, and the slowest of them beside what the other threads' runtime calls were doing
meanwhile (a call that blocks another thread's launches shows there).
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys
from collections import Counter
from pathlib import Path


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def summarize(path: str | Path, top: int = 12) -> str:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in timed if e.get("cat") == "kernel"]
    copies = [e for e in timed if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    runtime = [e for e in timed if e.get("cat") == "cuda_runtime"]
    ops = [e for e in timed if e.get("cat") == "cpu_op"]
    start = min(e["ts"] for e in timed)
    end = max(e["ts"] + e["dur"] for e in timed)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    lines = [
        f"== {path}",
        f"window {(end - start) / 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms "
        f"({busy / (end - start):.0%}), {len(kernels)} kernels, copies "
        f"{sum(e['dur'] for e in copies) / 1e3:.1f} ms",
    ]
    for title, group in (("kernels", kernels), ("cuda runtime", runtime), ("cpu ops", ops)):
        total: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for e in group:
            total[e["name"][:90]] += e["dur"]
            count[e["name"][:90]] += 1
        lines.append(f"-- {title} by total ms")
        lines += [f"{t / 1e3:10.2f} {count[n]:6d}  {n}" for n, t in total.most_common(top)]
    lines += _micro_batches(ops, kernels, end)
    lines += _timeline(kernels, copies, timed, start, end)
    lines += _main_thread(timed, ops, start)
    lines += _copy_delays(runtime, kernels, copies, start, top)
    lines += _threads(runtime, top)
    lines += _longest_sync(runtime, [*kernels, *copies])
    return "\n".join(lines)


def _longest_sync(runtime: list, gpu: list, last: int = 6) -> list[str]:
    """What the longest cudaStreamSynchronize waited for: the GPU work its thread launched last
    before it (stream, GPU start and end from the sync's start), and each stream's busy time and
    span during it (a stream whose work ends with the sync held it)."""
    syncs = [e for e in runtime if e["name"] == "cudaStreamSynchronize"]
    if not syncs:
        return []
    sync = max(syncs, key=lambda e: e["dur"])
    a, b = sync["ts"], sync["ts"] + sync["dur"]
    by_id = {e.get("args", {}).get("correlation"): e for e in gpu}
    launched = [
        e
        for e in runtime
        if e.get("tid") == sync.get("tid")
        and e["ts"] < a
        and e.get("args", {}).get("correlation") in by_id
    ]
    lines = [
        f"-- the longest cudaStreamSynchronize ({sync['dur'] / 1e3:.1f} ms): its thread's "
        "last launches (stream, GPU start / end ms from the sync's start)"
    ]
    for e in sorted(launched, key=lambda e: e["ts"])[-last:]:
        g = by_id[e["args"]["correlation"]]
        lines.append(
            f"  {e['name']} -> stream {_stream(g)} "
            f"{(g['ts'] - a) / 1e3:+.1f} / {(g['ts'] + g['dur'] - a) / 1e3:+.1f}  "
            f"{g['name'][:60]}"
        )
    lines.append("-- GPU streams during it: ops, busy ms, first start / last end ms")
    streams: dict = {}
    for g in gpu:
        if g["ts"] < b and g["ts"] + g["dur"] > a:
            streams.setdefault(_stream(g), []).append(g)
    for stream, group in sorted(streams.items(), key=lambda kv: str(kv[0])):
        busy = _union([(max(g["ts"], a), min(g["ts"] + g["dur"], b)) for g in group])
        names = Counter(g["name"][:40] for g in group).most_common(2)
        lines.append(
            f"  stream {stream}: {len(group)} ops, {busy / 1e3:.1f} ms, "
            f"{(min(g['ts'] for g in group) - a) / 1e3:+.1f} / "
            f"{(max(g['ts'] + g['dur'] for g in group) - a) / 1e3:+.1f}  {names}"
        )
    return lines


def _copy_delays(runtime: list, kernels: list, copies: list, start: float, top: int) -> list[str]:
    """The copies that waited longest to start on the GPU once launched and once their own
    stream's work before them had ended, each with its stream and what the other streams' copies
    were doing meanwhile (a small copy of the training's stream that waits for another stream's
    queue of copies shows here)."""
    launched = {e.get("args", {}).get("correlation"): e for e in runtime}
    ends: dict = {}  # per stream: (start, end) of its GPU work, in order
    for g in sorted([*kernels, *copies], key=lambda g: g["ts"]):
        ends.setdefault(_stream(g), []).append((g["ts"], g["ts"] + g["dur"]))
    waits = []
    for c in copies:
        call = launched.get(c.get("args", {}).get("correlation"))
        if call is None:
            continue
        spans = ends[_stream(c)]
        k = bisect.bisect_left(spans, (c["ts"],))  # the stream's work that began before it
        ready = max([call["ts"] + call["dur"], *(end for _, end in spans[k - 1 : k])])
        waits.append((c["ts"] - ready, c))
    lines = [
        "-- copies that waited longest once launched and their stream free: ms, stream, "
        "ready at ms, name | the other streams' copies meanwhile (count, MB)"
    ]
    for wait, c in sorted(waits, key=lambda w: -w[0])[:top]:
        a, stream = c["ts"] - wait, _stream(c)
        others: dict = {}
        for o in copies:
            if _stream(o) != stream and o["ts"] < c["ts"] and o["ts"] + o["dur"] > a:
                n, mb = others.get(_stream(o), (0, 0.0))
                others[_stream(o)] = (n + 1, mb + o.get("args", {}).get("bytes", 0) / 1e6)
        beside = ", ".join(f"stream {k}: {n}, {mb:.0f}" for k, (n, mb) in others.items())
        lines.append(
            f"  {wait / 1e3:8.1f} stream {stream} at {(a - start) / 1e3:+9.1f} "
            f"{c['name'][:32]} | {beside or 'none'}"
        )
    return lines


def _stream(event: dict):
    return event.get("args", {}).get("stream", event.get("tid"))


def _threads(runtime: list, top: int) -> list[str]:
    """Runtime calls per thread (count, total and longest ms), then the ``top`` longest calls,
    each with the other threads' calls that overlapped it the longest."""
    lines = ["-- cuda runtime by thread: calls, total ms, longest ms"]
    per: dict[tuple, list[float]] = {}
    for e in runtime:
        per.setdefault((e.get("tid"), e["name"]), []).append(e["dur"])
    for (tid, name), durs in sorted(per.items(), key=lambda kv: -sum(kv[1]))[: 2 * top]:
        lines.append(
            f"  tid {tid}: {len(durs):6d} {sum(durs) / 1e3:9.2f} {max(durs) / 1e3:8.2f}  {name}"
        )
    lines.append("-- the longest runtime calls, and what other threads' calls overlapped them")
    t0 = min((e["ts"] for e in runtime), default=0.0)
    for e in sorted(runtime, key=lambda e: -e["dur"])[:top]:
        a, b = e["ts"], e["ts"] + e["dur"]
        beside = sorted(
            (
                (min(b, o["ts"] + o["dur"]) - max(a, o["ts"]), o)
                for o in runtime
                if o.get("tid") != e.get("tid") and o["ts"] < b and o["ts"] + o["dur"] > a
            ),
            key=lambda x: -x[0],
        )[:3]
        others = (
            "; ".join(f"tid {o.get('tid')} {o['name']} {o['dur'] / 1e3:.2f} ms" for _, o in beside)
            or "nothing"
        )
        lines.append(
            f"  tid {e.get('tid')} {e['name']} {e['dur'] / 1e3:.2f} ms at "
            f"+{(a - t0) / 1e3:.1f} ms | beside: {others}"
        )
    return lines


def _total(events: list) -> float:
    return sum(e["dur"] for e in events)


def _main_thread(timed: list, ops: list, start: float, top: int = 10) -> list[str]:
    """The thread that runs the forward (its ``aten::embedding``): the annotations it and the
    others recorded (``torch.profiler.record_function``: count, total and longest ms, first
    start), then its ``top`` longest stretches with no op or runtime call running (where it
    waited outside CUDA: a lock, an event, another thread), each with what ended before it and
    what began after, ms from the window's start."""
    tids = Counter(e.get("tid") for e in ops if e["name"] == "aten::embedding")
    if not tids:
        return []
    main = tids.most_common(1)[0][0]
    notes: dict[tuple, list] = {}
    for e in timed:
        if e.get("cat") == "user_annotation":
            notes.setdefault((e["name"], e.get("tid") == main), []).append(e)
    lines = [
        "-- annotations: count, total ms, longest ms, first start ms (main: the forward's thread)"
    ]
    for (name, on_main), group in sorted(notes.items(), key=lambda kv: -_total(kv[1])):
        first = (min(e["ts"] for e in group) - start) / 1e3
        lines.append(
            f"  {'main ' if on_main else 'other'} {len(group):5d} "
            f"{_total(group) / 1e3:9.1f} {max(e['dur'] for e in group) / 1e3:8.1f} "
            f"{first:+9.1f}  {name[:70]}"
        )
    gaps = _idle(
        [e for e in timed if e.get("tid") == main and e.get("cat") in ("cpu_op", "cuda_runtime")]
    )
    marks = [e for (_, on_main), group in notes.items() if on_main for e in group]
    lines.append(
        "-- the forward's thread idle outside CUDA: ms, from ms, after -> before "
        "[the annotation around it]"
    )
    for gap, at, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        around = max(
            marks,
            default=None,
            key=lambda e: min(e["ts"] + e["dur"], after["ts"]) - max(e["ts"], at),
        )
        inside = around and min(around["ts"] + around["dur"], after["ts"]) > max(around["ts"], at)
        note = f" [{around['name'][:50]}]" if inside else ""
        lines.append(
            f"  {gap / 1e3:8.1f} {(at - start) / 1e3:+9.1f}  {before['name'][:40]} -> "
            f"{after['name'][:40]}{note}"
        )
    lines.append(
        "-- the other threads with 100 runtime calls or more: idle outside CUDA "
        "between calls, total ms and the longest three (from ms, after which call)"
    )
    calls: dict = {}
    for e in timed:
        if e.get("cat") == "cuda_runtime" and e.get("tid") != main:
            calls.setdefault(e.get("tid"), []).append(e)
    for tid, group in sorted(calls.items(), key=lambda kv: -len(kv[1])):
        if len(group) < 100:
            continue
        idle = sorted(_idle(group), key=lambda g: -g[0])
        longest = "; ".join(
            f"{g / 1e3:.1f} at {(at - start) / 1e3:+.1f} after {b['name']}"
            for g, at, b, _ in idle[:3]
        )
        lines.append(
            f"  tid {tid}: {len(group)} calls, idle {sum(g for g, *_ in idle) / 1e3:.1f}"
            f" ms; {longest}"
        )
    return lines


def _idle(events: list) -> list[tuple]:
    """The stretches between ``events`` (one thread's) where none ran: (µs, from, the event
    before, the event after)."""
    gaps, reach, last = [], None, None
    for e in sorted(events, key=lambda e: e["ts"]):
        if reach is not None and e["ts"] > reach:
            gaps.append((e["ts"] - reach, reach, last, e))
        if reach is None or e["ts"] + e["dur"] > reach:
            reach, last = e["ts"] + e["dur"], e
    return gaps


def _micro_batches(ops: list, kernels: list, end: float) -> list[str]:
    """Per micro-batch (a forward's ``aten::embedding`` to the next): host ms, GPU busy ms."""
    starts = sorted(e["ts"] for e in ops if e["name"] == "aten::embedding")
    if not starts:
        return []
    spans = list(zip(starts, [*starts[1:], end], strict=True))
    lines = [
        "-- micro-batches: host ms / GPU busy ms (forward start to the next; the last to "
        "the window's end)"
    ]
    for i, (a, b) in enumerate(spans):
        busy = _union(
            [
                (max(k["ts"], a), min(k["ts"] + k["dur"], b))
                for k in kernels
                if k["ts"] < b and k["ts"] + k["dur"] > a
            ]
        )
        lines.append(f"{i:3d} {(b - a) / 1e3:9.1f} {busy / 1e3:9.1f}")
    return lines


def _timeline(
    kernels: list, copies: list, timed: list, start: float, end: float, columns: int = 120
) -> list[str]:
    """Each busy GPU stream's kernels (K), copies up (U) and down (D) and other copies and
    memsets (M) over the window, a column per 1/``columns`` of it (digit: tenths busy, # all),
    above a row marking where each micro-batch's forward starts (|) and where the forward's
    thread waited for a state pass (w): which stream's work runs beside which, and where the
    compute stream sits idle."""
    width = (end - start) / columns

    def row(intervals: list[tuple[float, float]]) -> str:
        cells = []
        for c in range(columns):
            a, b = start + c * width, start + (c + 1) * width
            busy = _union([(max(s, a), min(e, b)) for s, e in intervals if s < b and e > a])
            tenths = round(9.49 * busy / width)
            cells.append(" " if busy == 0 else "#" if tenths >= 9 else str(max(tenths, 1)))
        return "".join(cells)

    def kind(e: dict) -> str:
        name = e["name"]
        if e.get("cat") == "kernel":
            return "K"
        return "U" if "HtoD" in name else "D" if "DtoH" in name else "M"

    groups: dict = {}
    for e in [*kernels, *copies]:
        groups.setdefault((_stream(e), kind(e)), []).append((e["ts"], e["ts"] + e["dur"]))
    lines = [
        f"-- timeline: a column per {width / 1e3:.1f} ms; K kernels, U copies up, D copies "
        "down, M other copies, per stream (busy tenths); | a forward starts, w the forward "
        "waits for a pass"
    ]
    for (stream, k), intervals in sorted(groups.items(), key=lambda g: str(g[0])):
        if _union(intervals) >= 0.005 * (end - start):
            lines.append(f"  {stream!s:>4} {k} {row(intervals)}")
    marks = [" "] * columns
    for e in timed:
        column = min(int((e["ts"] - start) / width), columns - 1)
        if e.get("cat") == "user_annotation" and "the forward waits" in e["name"]:
            for c in range(column, min(int((e["ts"] + e["dur"] - start) / width), columns - 1) + 1):
                marks[c] = "w"
        elif e["name"] == "aten::embedding":
            marks[column] = "|"
    lines.append(f"  host   {''.join(marks)}")
    return lines


if __name__ == "__main__":
    print("\n\n".join(summarize(p) for p in sys.argv[1:]))
