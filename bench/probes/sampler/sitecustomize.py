"""A sampling profiler for every Python process that puts this folder on PYTHONPATH (torchrun's
workers too): every 20 ms it records where each thread is, and at exit writes, per thread name,
the functions it spent most time in to ``$SAMPLE_STACKS_OUT/stacks-<pid>.txt``. For phases no other
profiler covers here, such as a rank's start-up before its first step:

    SAMPLE_STACKS_OUT=$OUT PYTHONPATH=bench/probes/sampler:$PYTHONPATH python run_recipe.py ...

``SWITCH_INTERVAL_S`` (with or without the sampler) sets the interpreter's switch interval
(``sys.setswitchinterval``, 5 ms by default): how long a thread that wants the GIL back waits for
one that runs Python, such as the training thread launching the next forward's kernels.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time

OUT = os.environ.get("SAMPLE_STACKS_OUT")
PROJECT = os.sep + "offload_runner" + os.sep
EVERY_S = 0.02


def _where(frame, thread: str) -> tuple[str, ...]:
    """A thread's stack as thread|file:function:line, outermost first."""
    stack = []
    while frame is not None:
        code = frame.f_code
        stack.append(
            f"{thread}|{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"
        )
        frame = frame.f_back
    return tuple(reversed(stack))


def _innermost_project_line(frame, thread: str) -> str | None:
    """thread|file:function:line of the innermost frame in offload_runner's code, if any."""
    while frame is not None:
        code = frame.f_code
        if PROJECT in code.co_filename:
            return f"{thread}|{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _start() -> None:
    counts: collections.Counter = collections.Counter()
    project: collections.Counter = collections.Counter()  # the innermost frame in the project
    began = time.perf_counter()

    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(EVERY_S):
            names = {t.ident: t.name.split("_")[0] for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != threading.get_ident():
                    counts[_where(frame, names.get(ident, "?"))] += 1
                    project[_innermost_project_line(frame, names.get(ident, "?"))] += 1

    def dump() -> None:
        stop.set()
        sampler.join()
        inclusive: collections.Counter = collections.Counter()  # file:function, callers too
        leaf: collections.Counter = collections.Counter()  # the innermost line
        for stack, n in counts.items():
            for entry in {e.rsplit(":", 1)[0] for e in stack}:
                inclusive[entry] += n
            leaf[stack[-1]] += n
        with open(os.path.join(OUT, f"stacks-{os.getpid()}.txt"), "w") as f:
            f.write(
                f"{sys.argv} {time.perf_counter() - began:.1f} s, {sum(counts.values())} "
                f"samples every {EVERY_S * 1000:.0f} ms\n-- seconds in each function "
                "(its callees included):\n"
            )
            for entry, n in inclusive.most_common(150):
                f.write(f"{n * EVERY_S:8.2f}  {entry}\n")
            f.write("-- seconds at each innermost line:\n")
            for entry, n in leaf.most_common(30):
                f.write(f"{n * EVERY_S:8.2f}  {entry}\n")
            f.write("-- seconds at each line of the project's innermost frame:\n")
            for entry, n in project.most_common(60):
                if entry:
                    f.write(f"{n * EVERY_S:8.2f}  {entry}\n")

    sampler = threading.Thread(target=sample, daemon=True, name="stack-sampler")
    sampler.start()
    atexit.register(dump)


if os.environ.get("SWITCH_INTERVAL_S"):
    sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL_S"]))
if OUT:
    _start()
