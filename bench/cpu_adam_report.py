#!/usr/bin/env python
"""The CPU-Adam engine's two reports, from their templates in bench/templates/ and the results
and evidence files (a part per analysis):

    python bench/cpu_adam_report.py cpu-adam-exact > docs/benchmarks/cpu-adam-exact.md
    python bench/cpu_adam_report.py cpu-adam-delayed > docs/benchmarks/cpu-adam-delayed.md
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

from fill import EVIDENCE_PARTS, fill, printed  # noqa: E402
from plots import curves  # noqa: E402
from suite_report import _cpu_adam_lines, convergence, tail_mean  # noqa: E402
from suites import CONVERGENCE_TAIL  # noqa: E402

REPORTS = ("cpu-adam-exact", "cpu-adam-delayed")


@printed
def cpu_adam1() -> None:

    for path in sorted(pathlib.Path("bench/results").glob("results-*.json")):
        data = json.loads(path.read_text())
        for r in data["results"]:
            if r["case"]["name"].endswith("GBS4 no offload") and r["case"].get("nproc", 1) == 1:
                s = r["summary"]
                print(
                    f"- `{path.name}` ({data['environment']['date'][:16]}): step "
                    f"{s['step_time_s_median'] * 1000:.0f} ms, forward+backward "
                    f"{s['fwd_bwd_time_s_median'] * 1000:.0f} ms"
                )


@printed
def cpu_adam2() -> None:

    for gbs in (1, 4):
        data = json.loads(
            pathlib.Path(f"bench/results/results-cpu-adam-split-{gbs}.json").read_text()
        )
        by = {r["case"]["name"]: r["summary"] for r in data["results"]}

        def step(name, by=by, gbs=gbs):
            return by[f"GBS{gbs} {name}"]["step_time_s_median"]

        share = by[f"GBS{gbs} cpu_adam 100%"]
        hdo, base = step("HDO 100% + overlap"), step("no offload")
        both, alone = step("cpu_adam 100%"), step("cpu_adam 100%, all on the CPU")
        print(
            f"- GBS {gbs} (commit {data['environment'].get('commit', '?')}): no offload "
            f"{base * 1000:.0f} ms (repeat {step('no offload (repeat)') * 1000:.0f}); cpu_adam "
            "100% "
            f"with a GPU share of {share['cpu_adam_gpu_share']:.2f} {both * 1000:.0f} ms, all on "
            "the "
            f"CPU {alone * 1000:.0f} ms ({alone / both:.2f}x slower); HDO 100% + overlap "
            f"{hdo * 1000:.0f} ms: {hdo / both:.2f}x the GPU share's step, {hdo / alone:.2f}x "
            "all on "
            f"the CPU's; peak {share['gpu_peak_allocated_gb']:.2f} GB against HDO's "
            f"{by[f'GBS{gbs} HDO 100% + overlap']['gpu_peak_allocated_gb']:.2f}, page-locked host "
            f"{share['host_pinned_gb_max']:.1f} GB (the moments too) against "
            f"{by[f'GBS{gbs} cpu_adam 100%, all on the CPU']['host_pinned_gb_max']:.1f}"
        )


@printed
def cpu_adam3() -> None:

    def rows(path):
        data = json.loads(pathlib.Path(path).read_text())
        return data["environment"]["commit"], {
            r["case"]["name"]: r["summary"] for r in data["results"]
        }

    for gbs in (1, 4):
        commit, by = rows(f"bench/results/results-cpu-adam-late-share-{gbs}.json")
        base, cpu = by[f"GBS{gbs} no offload"], by[f"GBS{gbs} cpu_adam_delayed 100%"]
        share = by[f"GBS{gbs} cpu_adam_delayed 100%, GPU share"]
        repeat = by[f"GBS{gbs} no offload (repeat)"]
        update = max(share["cpu_adam_wall_s_median"], share["cpu_adam_stream_s_median"])
        print(
            f"- GBS {gbs} (commit {commit}): no offload {base['step_time_s_median'] * 1000:.0f} ms "
            f"(repeat {repeat['step_time_s_median'] * 1000:.0f}); delayed 100% all on the CPU "
            f"{cpu['step_time_s_median'] * 1000:.0f} ms (its update "
            f"{cpu['cpu_adam_wall_s_median'] * 1000:.0f} ms, "
            f"forward+backward {cpu['fwd_bwd_time_s_median'] * 1000:.0f}); with the GPU share "
            f"(settled at {share['cpu_adam_gpu_share']:.2f}) "
            f"{share['step_time_s_median'] * 1000:.0f} ms "
            f"({cpu['step_time_s_median'] / share['step_time_s_median']:.2f}x the all-CPU step's "
            "speed; its update "
            f"{update * 1000:.0f} ms, forward+backward "
            f"{share['fwd_bwd_time_s_median'] * 1000:.0f}); peak "
            f"{share['gpu_peak_allocated_gb']:.2f} GB against {cpu['gpu_peak_allocated_gb']:.2f}"
        )
    commit, by = rows("docs/evidence/results-cpu-adam-late-share-1-ce6e28e.json")
    cpu, share = by["GBS1 cpu_adam_delayed 100%"], by["GBS1 cpu_adam_delayed 100%, GPU share"]
    print(
        f"- GBS 1 at commit {commit}, its share balanced on the CPU's and the window's rates "
        "alone: it "
        f"settled at {share['cpu_adam_gpu_share']:.2f}, the update took "
        f"{max(share['cpu_adam_wall_s_median'], share['cpu_adam_stream_s_median']) * 1000:.0f} "
        "ms against "
        f"{cpu['cpu_adam_wall_s_median'] * 1000:.0f} all on the CPU, yet the step "
        f"{share['step_time_s_median'] * 1000:.0f} ms against "
        f"{cpu['step_time_s_median'] * 1000:.0f}: the next "
        "backward's landings queued behind the window's copies on the link"
    )


@printed
def cpu_adam4() -> None:

    data = json.loads(pathlib.Path("bench/results/results-cpu-adam-experts-ep2.json").read_text())
    print(
        f"Commit {data['environment'].get('commit', '?')}, "
        f"{data['environment'].get('gpu_count')} x "
        f"{data['environment'].get('gpu')}; the loss is iteration 12's (delayed updates from "
        "step 3):"
    )
    print()
    for r in data["results"]:
        s = r["summary"]
        extra = ""
        if s.get("cpu_offloaded_params"):
            extra = (
                f", {s['cpu_adam_delayed_params'] / 1e9:.2f}B of its "
                f"{s['cpu_offloaded_params'] / 1e9:.2f}B "
                f"offloaded params per rank one step late"
            )
        print(
            f"- {r['case']['name']}: step {s['step_time_s_median'] * 1000:.0f} ms, peak "
            f"{s['gpu_peak_allocated_gb']:.2f} GB, loss {s['final_loss']:.4f}{extra}"
        )


@printed
def cpu_adam5() -> None:

    data = json.loads(pathlib.Path("bench/results/results-cpu-adam-landing.json").read_text())
    steps = {r["case"]["name"]: r["summary"]["step_time_s_median"] * 1000 for r in data["results"]}
    for gbs in (4, 1):
        base = steps[f"landing GBS{gbs} no offload"]
        during = steps[f"landing GBS{gbs} cpu_adam 100%, during the forward"]
        within = steps[f"landing GBS{gbs} cpu_adam 100%, within the step"]
        print(
            f"- GBS {gbs}: no offload {base:.0f} ms; cpu_adam 100% landing during the forward "
            f"{during:.0f} ms, within the step {within:.0f} ms ({within - during:.0f} ms, "
            f"{within / during - 1:.0%} slower; commit {data['environment']['commit']})"
        )


@printed
def cpu_adam6() -> None:

    names = (
        "results-cpu-adam-4.json",
        "results-cpu-adam-4-delayed.json",
        "results-cpu-adam-4-backward.json",
        "results-cpu-adam-4-pieces.json",
    )
    for name in names:
        data = json.loads((pathlib.Path("bench/results") / name).read_text())
        by_name = {r["case"]["name"]: r["summary"] for r in data["results"] if r["status"] == "ok"}
        base = by_name["GBS4 no offload"]
        for case, s in by_name.items():
            if s.get("cpu_adam_mode") != "delayed":
                continue
            copies = 4 * s["cpu_offloaded_params"] / 50.8e9 * 1000
            rest = s["step_time_s_median"] * 1000 - s["fwd_bwd_time_s_median"] * 1000
            base_rest = (base["step_time_s_median"] - base["fwd_bwd_time_s_median"]) * 1000
            where = (
                "during the last backward"
                if s.get("cpu_adam_copies_in_backward")
                else "at the step boundary"
            )
            waited = s.get("cpu_adam_boundary_s_median")
            print(
                f"- {case} (`{name}`, commit {data['environment']['commit']}): step "
                f"{s['step_time_s_median'] * 1000:.0f} ms against the baseline's "
                f"{base['step_time_s_median'] * 1000:.0f}; copies {where} ({copies:.0f} ms"
                + (f"; step() waited {waited * 1000:.0f} ms" if waited is not None else "")
                + f"); rest {rest:.0f} ms against the baseline's {base_rest:.0f}; forward+backward "
                f"{s['fwd_bwd_time_s_median'] * 1000:.0f} against "
                f"{base['fwd_bwd_time_s_median'] * 1000:.0f}; "
                f"CPU Adam {s['cpu_adam_busy_s_median'] * 1000:.0f} ms, the worker's whole update "
                f"{s['cpu_adam_wall_s_median'] * 1000:.0f}"
            )


@printed
def cpu_adam7() -> None:

    data = json.loads(pathlib.Path("bench/results/results-cpu-adam-4-backward.json").read_text())
    s = {r["case"]["name"]: r["summary"] for r in data["results"] if r["status"] == "ok"}
    during = s["GBS4 cpu_adam_delayed 100%"]
    boundary = s["GBS4 cpu_adam_delayed 100%, copies at the step boundary"]
    copies = 4 * during["cpu_offloaded_params"] / 50.8e9 * 1000
    print(
        "Copying during the backward takes the copies out of `step()`: in `cpu-adam-4-backward` "
        "it "
        f"waited {during['cpu_adam_boundary_s_median'] * 1000:.0f} ms instead of "
        f"{boundary['cpu_adam_boundary_s_median'] * 1000:.0f}, and the step fell from "
        f"{boundary['step_time_s_median'] * 1000:.0f} to "
        f"{during['step_time_s_median'] * 1000:.0f} ms. "
        f"The copies need {copies:.0f} ms at 100%, longer than the last micro-batch's backward at "
        "GBS 4, so a tail remains (`plan.copy_window` counts it, for `--plan`, `auto` and the "
        "hidden fraction)."
    )


@printed
def cpu_adam8() -> None:

    for name, case in (
        ("results-cpu-adam-4-pieces.json", "GBS4 cpu_adam_delayed 100%, 64 MiB pieces"),
        ("results-cpu-adam-4-backward.json", "GBS4 cpu_adam_delayed 100%"),
        ("results-cpu-adam-4.json", "GBS4 cpu_adam_delayed 100%"),
        ("results-cpu-adam-4-delayed.json", "GBS4 cpu_adam_delayed 100%"),
    ):
        data = json.loads((pathlib.Path("bench/results") / name).read_text())
        by = {r["case"]["name"]: r["summary"] for r in data["results"] if r["status"] == "ok"}
        s, base = by[case], by["GBS4 no offload"]
        busy, step = s["cpu_adam_busy_s_median"], s["step_time_s_median"]
        bound = max(base["step_time_s_median"], busy)
        print(
            f"- `{name}` (commit {data['environment']['commit']}), {case}: waited "
            f"{s['cpu_adam_wait_s_median'] * 1000:.0f} ms for gradients, whole update "
            f"{(s['cpu_adam_wall_s_median'] - busy) * 1000:.0f} ms past its Adam calls; step "
            f"{step * 1000:.0f} ms = {step / bound:.2f}x its bound "
            f"max({base['step_time_s_median'] * 1000:.0f}, "
            f"{busy * 1000:.0f})"
        )


@printed
def cpu_adam9() -> None:

    data = json.loads(pathlib.Path("bench/results/results-cpu-adam-4-delayed.json").read_text())
    by = {r["case"]["name"]: r for r in data["results"] if r["status"] == "ok"}
    full = by["GBS4 cpu_adam_delayed 100%"]["summary"]
    hidden = by["GBS4 cpu_adam_delayed at its hidden fraction"]
    h = hidden["summary"]
    fraction = next(
        o.split("=")[1]
        for o in hidden["case"]["overrides"][::-1]
        if o.startswith("optimizer.optimizer_offload_fraction=")
    )
    steps = [
        by[n]["summary"]["step_time_s_median"]
        for n in ("GBS4 no offload", "GBS4 no offload (repeat)")
    ]
    peak = by["GBS4 no offload"]["summary"]["gpu_peak_allocated_gb"]
    print(
        f"- `results-cpu-adam-4-delayed.json` (commit {data['environment']['commit']}): delayed "
        "100% "
        f"reported a hidden fraction of {full['cpu_adam_hidden_fraction']:.3f} (slowdown "
        f"{full['cpu_adam_launch_slowdown']:.2f}, forward+backward without offload taken as "
        f"{full['cpu_adam_forward_backward_without_s'] * 1000:.0f} ms); at {fraction} the step "
        "took "
        f"{h['step_time_s_median'] * 1000:.0f} ms = {h['step_time_s_median'] / steps[0]:.2f}x the "
        f"baseline ({h['step_time_s_median'] / steps[1]:.2f}x its repeat), peak "
        f"{h['gpu_peak_allocated_gb']:.2f} GB, {peak - h['gpu_peak_allocated_gb']:.2f} GB below "
        "the baseline's"
    )
    data = json.loads(pathlib.Path("bench/results/results-cpu-adam-4.json").read_text())
    by = {r["case"]["name"]: r for r in data["results"] if r["status"] == "ok"}
    full = by["GBS4 cpu_adam_delayed 100%"]
    given = [o for o in full["command"] if o.startswith("planner.forward_backward_s=")]
    if given:
        h = by["GBS4 cpu_adam_delayed at its hidden fraction"]["summary"]
        peak = by["GBS4 no offload"]["summary"]["gpu_peak_allocated_gb"]
        print(
            f"- `results-cpu-adam-4.json` (commit {data['environment']['commit']}): the delayed "
            "100% row "
            f"was given its suite's first baseline ({given[0]}) and measured a slowdown of "
            f"{full['summary']['cpu_adam_launch_slowdown']:.2f}, the drift below included: its "
            "hidden "
            f"fraction {full['summary']['cpu_adam_hidden_fraction']:.3f} saved "
            f"{peak - h['gpu_peak_allocated_gb']:.2f} GB; the bench has not measured it since"
        )


@printed
def cpu_adam10() -> None:

    files = sorted(pathlib.Path("bench/results").glob("results-cpu-adam-4*.json"))
    files += sorted(pathlib.Path("docs/evidence").glob("results-cpu-adam-4-*.json"))
    slower = 0
    for path in files:
        data = json.loads(path.read_text())
        by = {r["case"]["name"]: r["summary"] for r in data["results"] if r["status"] == "ok"}
        if "GBS4 no offload (repeat)" not in by:
            continue
        a, b = (
            by[n]["step_time_s_median"] * 1000
            for n in ("GBS4 no offload", "GBS4 no offload (repeat)")
        )
        slower += b > a
        print(
            f"- `{path.name}` (commit {data['environment']['commit']}): {a:.0f} ms, repeat "
            f"{b:.0f} ms ({b / a - 1:+.0%})"
        )
        runs = locals().get("runs", 0) + 1
    print()
    print(
        f"The repeat ran slower in {slower} of these {runs} suites: the host after minutes of "
        "CPU Adam "
        "is not the host before them, so a run mid-suite stands between its two baselines, and a "
        "bar of 1.15x one of them is within this drift."
    )


@printed
def cpu_adam11() -> None:

    data = json.loads(pathlib.Path("bench/results/results-adam-parity.json").read_text())
    losses = {
        r["case"]["name"]: r["summary"]["losses"] for r in data["results"] if r["status"] == "ok"
    }
    names = list(losses)
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for a in names:
        cells = [
            f"{max(abs(x - y) for x, y in zip(losses[a], losses[b], strict=True)):.2e}"
            for b in names
        ]
        print(f"| {a} | " + " | ".join(cells) + " |")
    gpu = max(abs(x - y) for x, y in zip(*(losses[n] for n in names[:2]), strict=True))
    print()
    print(
        "Two correct GPU kernels, torch's fused AdamW and Transformer Engine's FusedAdam, part the"
    )
    print(
        f"losses by {gpu:.2e} over these 20 iterations: last-bit differences in fp32 flip bf16 "
        "roundings"
    )
    print(
        "of the weights, and the tiny recipe (lr 1e-3 after 2 warmup iterations) carries them "
        "into the"
    )
    print("loss. The CPU engine sits at that distance from both GPU kernels and at 0 from")
    print(
        "HybridDeviceOptimizer (both run torch's fused AdamW on the CPU), landing during the "
        "forward or"
    )
    print(
        "within the step alike; its first two losses equal GPU Adam's. A bar of 1e-3 against GPU "
        "Adam is"
    )
    print(
        "below what one GPU Adam kernel keeps against another (commit "
        f"{data['environment']['commit']})."
    )


@printed
def cpu_adam12() -> None:

    for path in sorted(pathlib.Path("docs/evidence").glob("results-cpu-adam-4-*.json")):
        data = json.loads(path.read_text())
        env = data["environment"]
        results = [{**r, "environment": env, "source": path.name} for r in data["results"]]
        by_name = {r["case"]["name"]: r for r in results}
        steps = {
            n: by_name[n]["summary"]["step_time_s_median"] * 1000
            for n in ("GBS4 no offload", "GBS4 no offload (repeat)", "GBS4 HDO 100% + overlap")
            if n in by_name
        }
        rate = env.get("cpu_adam_reference_params_per_s", {}).get("16")
        print(
            f"`{path.name}` (commit {env['commit']}, {env['date'][:16]}): steps "
            + ", ".join(f"{n.removeprefix('GBS4 ')} {v:.0f} ms" for n, v in steps.items())
            + (f"; torch's fused AdamW alone {rate / 1e9:.2f} G/s on 16 threads" if rate else "")
            + ":"
        )
        print()
        for line in _cpu_adam_lines(results, by_name)[3:]:
            print(line)
        print()


@printed
def cpu_adam13() -> None:

    runs = {
        name: statistics.fmean(losses[-20:])
        for path in sorted(pathlib.Path("bench/results").glob("results-cpu-adam-long-*.json"))
        for name, losses in curves(path)
    }
    for name, final in runs.items():
        print(f"- {name}: mean loss of the last 20 iterations {final:.3f}")
    print()
    exact = [v for k, v in runs.items() if "delayed" not in k]
    print(
        f"Two runs of the same exact command end {max(exact) - min(exact):.2f} apart here (MoE "
        "routing and TE"
    )


@printed
def delayed1() -> None:

    files = [
        *sorted(pathlib.Path("bench/results").glob("results-cpu-adam-conv-*.json")),
        *sorted(pathlib.Path("docs/evidence").glob("cpu-adam-conv-predicting-seed*.jsonl")),
    ]
    runs = {name: losses for path in files for name, losses in curves(path)}

    def reached(losses, level=0.1, window=20):
        """The first iteration whose trailing 20-iteration mean is below ``level``."""
        for i in range(window, len(losses) + 1):
            if statistics.fmean(losses[i - window : i]) < level:
                return i
        return None

    print(
        "| run | iterations | first 20-iteration mean below 0.1 at | mean of iterations 141-160 |"
    )
    print("|---|---|---|---|")
    for name, losses in runs.items():
        late = statistics.fmean(losses[140:160])
        print(f"| {name} | {len(losses)} | {reached(losses)} | {late:.3f} |")
    print()
    base = [v for k, v in runs.items() if "no offload" in k]
    delayed = [v for k, v in runs.items() if k.startswith("conv cpu_adam_delayed seed")]
    predicting = [v for k, v in runs.items() if "predicting" in k]
    experts = [v for k, v in runs.items() if "experts only" in k]

    def mean(group):
        return statistics.fmean(reached(v) for v in group)

    print(
        "Delayed updates of every parameter reach the 0.1 level "
        f"{mean(delayed) - mean(base):.0f} iterations "
        "after the baseline (mean over seeds), with weight prediction "
        f"{mean(predicting) - mean(base):.0f}, "
        'for the "experts only" runs (the embedding and first layers exact) '
        f"{mean(experts) - mean(base):.0f}."
    )


@printed
def delayed2() -> None:

    results = [
        r
        for path in sorted(pathlib.Path("bench/results").glob("results-cpu-adam-ep2-conv-*.json"))
        for r in json.loads(path.read_text())["results"]
    ]
    found = convergence(results)
    print(
        "| run | step ms | delayed params per rank | offloaded params per rank | final loss "
        "(mean of the "
        f"last {CONVERGENCE_TAIL}) |"
    )
    print("|---|---|---|---|---|")
    for r in results:
        s = r["summary"]
        delayed, offloaded = s.get("cpu_adam_delayed_params"), s.get("cpu_offloaded_params")
        print(
            f"| {r['case']['name']} | {s['step_time_s_median'] * 1000:.0f} | "
            f"{f'{delayed / 1e9:.2f}B' if delayed else '-'} | "
            f"{f'{offloaded / 1e9:.2f}B' if offloaded else '-'} | "
            f"{tail_mean(s['losses']):.4f} |"
        )
    print()
    for name, row in found["runs"].items():
        verdict = "within" if row["within_noise"] else "outside"
        print(
            f"- {name}: mean final loss {row['gap']:+.4f} against the baseline's, {verdict} its "
            "spread "
            f"across seeds ({found['spread']:.4f})"
        )


PARTS = {
    **EVIDENCE_PARTS,
    "cpu_adam1": cpu_adam1,
    "cpu_adam2": cpu_adam2,
    "cpu_adam3": cpu_adam3,
    "cpu_adam4": cpu_adam4,
    "cpu_adam5": cpu_adam5,
    "cpu_adam6": cpu_adam6,
    "cpu_adam7": cpu_adam7,
    "cpu_adam8": cpu_adam8,
    "cpu_adam9": cpu_adam9,
    "cpu_adam10": cpu_adam10,
    "cpu_adam11": cpu_adam11,
    "cpu_adam12": cpu_adam12,
    "cpu_adam13": cpu_adam13,
    "delayed1": delayed1,
    "delayed2": delayed2,
}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in REPORTS:
        print(f"usage: python bench/cpu_adam_report.py {{{'|'.join(REPORTS)}}}", file=sys.stderr)
        return 2
    print(fill(f"{sys.argv[1]}.md", PARTS), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
