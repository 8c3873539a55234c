#!/usr/bin/env python
"""Where exact offload's forward+backward time goes: docs/benchmarks/forward-backward.md, the
words of bench/templates/forward-backward.md filled from the profiles, probes and results.

    python bench/forward_backward.py > docs/benchmarks/forward-backward.md
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from fill import SHARED_PARTS, fill, printed  # noqa: E402


def order() -> str:
    """The alternating runs of docs/evidence/fwd-bwd-order-h200.txt: row, step s, fwd+bwd s."""
    path = ROOT / "docs/evidence/fwd-bwd-order-h200.txt"
    rows = [ln.split()[:3] for ln in path.read_text().splitlines() if ln and ln[0] != "#"]
    return "\n".join(" ".join(r) for r in rows)


@printed
def micro_batches() -> None:
    """Each micro-batch's host span and GPU busy time of the three profiled runs
    (docs/evidence/profile-mb), and their kernel launches' cost."""
    rows = {}
    for name in ("base", "cpu_adam", "states"):
        text = ROOT.joinpath(f"docs/evidence/profile-mb/trace-{name}.txt").read_text()
        part = text.split("-- micro-batches", 1)[1].split("\n--", 1)[0].splitlines()[1:]
        rows[name] = [tuple(float(x) for x in line.split()[1:3]) for line in part if line.strip()]
    names = {"base": "no offload", "cpu_adam": "cpu_adam", "states": "states"}
    count = len(rows["base"])
    print(
        "| run | "
        + " | ".join(f"MB {i}" for i in range(count))
        + " | mean host ms before the last |"
    )
    print("|---|" + "---|" * (count + 1))
    for name, spans in rows.items():
        mean = sum(h for h, _ in spans[:-1]) / (len(spans) - 1)
        print(
            f"| {names[name]} | "
            + " | ".join(f"{h:.0f} / {g:.0f}" for h, g in spans)
            + f" | {mean:.0f} |"
        )
    print()
    for name in rows:
        text = ROOT.joinpath(f"docs/evidence/profile-mb/trace-{name}.txt").read_text()
        launch = re.search(r"^\s*([\d.]+)\s+(\d+)\s+cudaLaunchKernel", text, re.M)
        print(
            f"- {names[name]}: cudaLaunchKernel {launch[1]} ms over {launch[2]} calls in the step "
            f"({float(launch[1]) * 1000 / int(launch[2]):.1f} us each)"
        )


@printed
def drift() -> None:
    """What the host alone drifts by (bench/probes/host_drift_probe.py's two evidence files)."""
    text = {
        n: ROOT.joinpath(f"docs/evidence/host-drift-probe{n}-h100.txt").read_text()
        for n in ("", "-steal")
    }
    spans = [
        re.search(rf"^{k}: ([\d.]+)-([\d.]+) ms over (\d+) rounds, max/min ([\d.]+)x", t, re.M)
        for t in text.values()
        for k in ("launches", "python loop")
    ]
    steal = sorted({float(x) for x in re.findall(r"steal\s+([\d.]+)%", text["-steal"])})
    print(
        "The host alone drifts by more than any of these ratios. "
        "`python bench/probes/host_drift_probe.py` "
        "(docs/evidence/host-drift-probe-h100.txt, -steal-h100.txt), nothing else running on one "
        "H100 machine, timed 20,000 launches of a small kernel from one thread (what bounds the "
        "proxy's forward+backward at MB 1) and a plain Python loop every 10 s for 4 and 3 minutes: "
        f"the launches took {spans[0][1]}-{spans[0][2]} ms ({spans[0][4]}x) and "
        f"{spans[2][1]}-{spans[2][2]} ms ({spans[2][4]}x), the loop {spans[1][1]}-{spans[1][2]} ms "
        f"({spans[1][4]}x) and {spans[3][1]}-{spans[3][2]} ms ({spans[3][4]}x), while the CPUs' "
        f"steal time read {'-'.join(sorted({f'{steal[0]:g}', f'{steal[-1]:g}'}))}% in every "
        "round: the hypervisor does "
        "not report it. A 3% bar on forward+backward cannot be measured on these machines; the "
        "engines' own share of it is what the profile above shows, and state offload's median "
        "across suites is no offload's."
    )


@printed
def engines() -> None:
    """Every one-GPU proxy row of the plain engines: forward+backward over its suite's
    no-offload runs at the same batch."""
    ENGINES = {
        "offload/optimizer=states": "states",
        "offload/optimizer=cpu_adam": "cpu_adam",
        "offload/optimizer=cpu_100": "HDO 100%",
    }
    found: dict[str, list[tuple[str, float]]] = {name: [] for name in ENGINES.values()}

    def split(r):
        """(global batch, the row's other overrides)"""
        o = r["case"]["overrides"]
        gbs = next(
            (int(m[1]) for x in o if (m := re.match(r"train.global_batch_size=(\d+)", x))), None
        )
        return gbs, frozenset(x for x in o if "batch_size" not in x)

    for path in sorted(ROOT.joinpath("bench/results").glob("results-*.json")):
        data = json.loads(path.read_text())
        gpu = data["environment"]["gpu"].replace("NVIDIA ", "").split()[0]
        rows = [
            r
            for r in data["results"]
            if r["case"]["recipe"] == "qwen3_30b_a3b_proxy"
            and r["case"].get("nproc", 1) == 1
            and r["summary"].get("fwd_bwd_time_s_median")
        ]
        bases = [
            (*split(r), r)
            for r in rows
            if not any(x.startswith("offload/") for x in r["case"]["overrides"])
        ]
        for r in rows:
            gbs, keys = split(r)
            # the suite's no-offload runs at this batch: their keys this row's less one engine's
            same = [b for bg, bk, b in bases if bg == gbs and bk <= keys and len(keys - bk) == 1]
            extra = {
                next(iter(keys - bk))
                for bg, bk, _ in bases
                if bg == gbs and bk <= keys and len(keys - bk) == 1
            }
            name = ENGINES.get(next(iter(extra))) if len(extra) == 1 else None
            if not name or not same:
                continue
            if name == "cpu_adam" and "cpu_adam_gpu_share" not in r["summary"]:
                continue  # an engine before its GPU share and landing during the forward
            base = statistics.mean(b["summary"]["fwd_bwd_time_s_median"] for b in same)
            ratio = r["summary"]["fwd_bwd_time_s_median"] / base
            found[name].append(
                (f"{path.stem.removeprefix('results-')} ({gpu}, GBS {gbs}) {ratio:.2f}x", ratio)
            )
    print(
        "Every one-GPU proxy row of the plain engines in bench/results, its forward+backward "
        "against the no-offload runs of its own suite at the same global batch (cpu_adam: the "
        "engine with its GPU share, landing during the forward). HybridDeviceOptimizer does "
        "nothing during forward and "
        "backward, so its spread is the hosts':"
    )
    print()
    print("| engine | rows | median | range | each |")
    print("|---|---|---|---|---|")
    for name, got in found.items():
        ratios = [x for _, x in got]
        print(
            f"| {name} | {len(got)} | {statistics.median(ratios):.2f}x | {min(ratios):.2f}-"
            f"{max(ratios):.2f}x | {'; '.join(t for t, _ in got)} |"
        )
    med = {name: statistics.median(x for _, x in got) for name, got in found.items()}
    noise = [x for _, x in found["HDO 100%"]]
    print()
    print(
        f"State offload's forward+backward is no-offload's (median {med['states']:.2f}x); "
        "exact CPU "
        f"Adam's median is {med['cpu_adam']:.2f}x, inside the {min(noise):.2f}-{max(noise):.2f}x "
        "that HybridDeviceOptimizer, idle during forward and backward, spans on the same hosts: a "
        "cost of that size cannot be told from the hosts' noise with one run per row."
    )


PARTS = {
    **SHARED_PARTS,
    "micro_batches": micro_batches,
    "order": order,
    "drift": drift,
    "engines": engines,
}


if __name__ == "__main__":
    print(fill("forward-backward.md", PARTS), end="")
