#!/usr/bin/env python
"""Run the offload benchmark matrix on a GPU machine, and render docs/BENCHMARKS.md from it.

    # on the GPU machine (one suite per call; each case is a real run_recipe.py training run)
    python bench/run_benchmarks.py run --suite proxy-1 --out results-proxy-1.json
    # anywhere: the Markdown report from one or more result files
    python bench/run_benchmarks.py report results-*.json > docs/BENCHMARKS.md

Every number in the report comes from the runs' own summary.json / metrics.jsonl; the result
file also records the command of each case, the GPU, and the package versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from suite_report import _families, render  # noqa: E402
from suites import ITERS, SUITES, Case  # noqa: E402

from offload_runner.checkpoint import tracked  # noqa: E402
from offload_runner.hardware import fused_adamw_rate  # noqa: E402
from offload_runner.launch import OOM_MARKERS  # noqa: E402
from offload_runner.rundir import STATUS_FILE, SUMMARY_FILE, read_json  # noqa: E402


@dataclass
class Result:
    case: dict
    command: list[str]
    returncode: int
    status: str
    wall_s: float
    summary: dict = field(default_factory=dict)
    error_tail: str = ""
    round: int = 1  # --rounds: which pass over the suite's cases
    started_at: float = 0.0  # epoch s (with the summary's launched_at and summary_written_at)
    segment: list[int] = field(default_factory=list)  # --segment: [first, last] iteration


def environment() -> dict:
    import torch

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count(),
        "commit": os.environ.get("OFFLOAD_RUNNER_COMMIT", "unknown"),
    }
    for module in ("megatron.core", "transformer_engine"):
        try:
            mod = __import__(module, fromlist=["__version__"])
            info[module] = getattr(mod, "__version__", "?")
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            info[module] = f"not importable: {type(err).__name__}"
    return info


def _rank_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("rank*.log")))


def at_hidden_fraction(case: Case, results: list[dict]) -> Case:
    """``case`` at the offload fraction its ``hidden_fraction_of`` run reported, rounded down to
    a hundredth (unchanged when that run reported none)."""
    found = next(
        (
            r["summary"].get("cpu_adam_hidden_fraction")
            for r in results
            if r["case"]["name"] == case.hidden_fraction_of
        ),
        None,
    )
    if not found:
        return case
    fraction = math.floor(found * 100) / 100
    found_fraction = f"optimizer.optimizer_offload_fraction={fraction}"
    return replace(case, overrides=(*case.overrides, found_fraction))


def segment_of(case: Case, out_dir: Path, iters: int, every: int) -> tuple[int, int, tuple]:
    """``--segment``: the next ``every`` iterations of ``case``'s ``iters``, resumed from its
    checkpoint where an earlier call of the same machine left one: (first iteration, last,
    overrides). The learning-rate schedule is the whole run's; the segment saves at its end."""
    saved = out_dir / "checkpoints" / case.slug
    done = int(tracked(saved) or 0)
    extra = [f"scheduler.lr_decay_iters={iters}", f"checkpoint.save={saved}"]
    extra += [f"checkpoint.save_interval={every}"] + [f"checkpoint.load={saved}"] * bool(done)
    return done, min(iters, (done // every + 1) * every), tuple(extra)


def run_case(case: Case, out_dir: Path, iters: int, segment: int = 0) -> Result:
    first, iters, extra = segment_of(case, out_dir, iters, segment) if segment else (0, iters, ())
    if segment and first >= iters:  # an earlier call ran it to the end
        return Result(asdict(case), [], 0, "done", 0.0, segment=[first, iters])
    run_dir = out_dir / (f"{case.slug}-to-{iters}" if segment else case.slug)
    command = case.command(run_dir, iters, extra)
    began, started_at = time.perf_counter(), time.time()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - began
    summary = read_json(run_dir / SUMMARY_FILE)
    text = proc.stdout + proc.stderr
    if summary and (chose := re.search(r"^auto: (.*)$", proc.stdout, re.M)):
        summary["auto"] = chose.group(1)  # what offload/*=auto picked, and why
    recorded = read_json(run_dir / STATUS_FILE).get("status")  # what the launcher decided
    if proc.returncode == 0 and summary:
        status = "ok"
    elif recorded == "oom" or any(m in text for m in OOM_MARKERS):
        status = "OOM"
    else:
        status = f"failed ({proc.returncode})"
    return Result(
        case=asdict(case),
        command=["python", "run_recipe.py", *command[2:-2]],  # without the machine's paths
        returncode=proc.returncode,
        status=status,
        wall_s=wall,
        summary=summary,
        # the launcher's own last lines (its one-line verdict), then the ranks' logs
        error_tail="" if status == "ok" else text[-1000:] + "\n" + _rank_logs(run_dir)[-2000:],
        segment=[first, iters] if segment else [],
        started_at=started_at,
    )


def cmd_run(args: argparse.Namespace) -> int:
    cases = SUITES[args.suite]
    if args.jobs > 1 and any(c.hidden_fraction_of for c in cases):
        sys.exit(f"--jobs: suite {args.suite} has rows that wait for an earlier row's result")
    if args.start_at:  # a later call of a suite that a time limit cut: its missing rows first
        first = next(i for i, c in enumerate(cases) if c.name == args.start_at)
        cases = cases[first:] + cases[:first]
    cases = cases[: args.count or None]
    env = environment()
    if any("cpu_adam" in " ".join(c.overrides) for c in cases):
        cores = len(os.sched_getaffinity(0))
        env["cpu_adam_reference_params_per_s"] = {
            str(n): fused_adamw_rate(n) for n in sorted({cores, max(1, cores - 2)})
        }
        print(f"torch AdamW(fused=True) alone: {env['cpu_adam_reference_params_per_s']}")
    rounds = [(n, c) for n in range(1, args.rounds + 1) for c in cases]  # A B .. A B ..
    results: list[dict] = []

    def record(result: Result) -> None:
        results.append(asdict(result))
        _print_result(result)
        saved = {"suite": args.suite, "environment": env, "iters": args.iters, "jobs": args.jobs}
        saved["results"] = results
        Path(args.out).write_text(json.dumps(saved, indent=1))

    if args.jobs > 1:
        _run_side_by_side(rounds, args, record)
    else:
        _run_in_turn(rounds, args, record, results)
    return 0


def _run_one(round_: int, case: Case, args: argparse.Namespace) -> Result:
    result = run_case(case, Path(args.work_dir) / f"round{round_}", args.iters, args.segment)
    result.round = round_
    return result


def _run_in_turn(rounds, args: argparse.Namespace, record, results: list[dict]) -> None:
    """One case after another, none started that --time-limit would cut."""
    began = time.perf_counter()
    for round_, case in rounds:
        longest = max((r["wall_s"] for r in results), default=0.0)
        if args.time_limit and time.perf_counter() - began + longest > args.time_limit:
            print(f"{case.name}: not started, the next case would pass --time-limit", flush=True)
            continue
        if case.hidden_fraction_of:
            case = at_hidden_fraction(case, results)
        record(_run_one(round_, case, args))


def _run_side_by_side(rounds, args: argparse.Namespace, record) -> None:
    """--jobs cases at once on the same GPUs: for suites whose finding is the loss, not the
    time (their step times are not comparable). Results are recorded as they finish."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    with ThreadPoolExecutor(args.jobs) as pool:
        running = [pool.submit(_run_one, n, case, args) for n, case in rounds]
        for done in as_completed(running):
            record(done.result())


def _print_result(result: Result) -> None:
    s = result.summary
    print(
        f"{result.case['name']:32s} {result.status:10s} wall {result.wall_s:6.1f}s "
        f"step {s.get('step_time_s_median', float('nan')) * 1000:8.1f} ms "
        f"peak {s.get('gpu_peak_allocated_gb', float('nan')):6.2f} GB "
        f"loss {s.get('final_loss', float('nan')):.4f}",
        flush=True,
    )


# --- report -----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one suite on this GPU machine")
    run.add_argument("--suite", choices=sorted(SUITES), required=True)
    run.add_argument("--out", required=True, help="result JSON file")
    run.add_argument("--work-dir", default="bench-runs", help="where the run directories go")
    run.add_argument("--iters", type=int, default=ITERS)
    run.add_argument("--rounds", type=int, default=1, help="passes over the cases, interleaved")
    run.add_argument("--start-at", help="the case to start with (the rest follow in turn)")
    run.add_argument("--count", type=int, default=0, help="run this many cases (0: all)")
    run.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cases at once (suites that measure loss, not time; no --time-limit then)",
    )
    run.add_argument(
        "--segment",
        type=int,
        default=0,
        help="iterations a call runs of each case, resumed from where an earlier call on the "
        "same machine saved it (--work-dir kept): long runs over several calls",
    )
    run.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: start no case that would end past this (the longest so far)",
    )
    report = sub.add_parser("report", help="Markdown from result files")
    report.add_argument("files", nargs="+", type=Path)
    report.add_argument("--suite", help="one suite's runs in full (its tables and commands)")
    args = parser.parse_args()
    if args.command == "run":
        return cmd_run(args)
    families = _families(args.files)
    if args.suite is not None and args.suite not in families:
        known = ", ".join(sorted(families))
        print(f"error: no results of suite {args.suite!r}; one of: {known}", file=sys.stderr)
        return 2
    print(render(args.files, args.suite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
