#!/usr/bin/env python
"""The multi-GPU runs, the gpu-marked tests and verify: docs/benchmarks/gpu-tests.md, the words
of bench/templates/gpu-tests.md filled from bench/results and docs/evidence.

    python bench/gpu_tests.py > docs/benchmarks/gpu-tests.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from fill import EVIDENCE, SHARED_PARTS, fill  # noqa: E402


def tails() -> str:
    """Per pytest-gpu evidence file: its FAILED lines, CP2-vs-DP2 line and pytest's tally."""
    keep = re.compile(r"^(FAILED|CP2 vs DP2|[0-9]+ (passed|failed))")
    lines = []
    for path in sorted(EVIDENCE.glob("pytest-gpu*.txt")):
        said = [re.sub(r"^=+ | =+$", "", ln) for ln in path.read_text().splitlines()]
        lines.append(f"- `evidence/{path.name}`: {'; '.join(s for s in said if keep.match(s))}")
    return "\n".join(lines)


def verify() -> str:
    """The recorded verify reports, their titles one level down."""
    return "\n".join(
        re.sub(r"^# ", "### ", p.read_text(), flags=re.M)
        for p in sorted(EVIDENCE.glob("verify-*.md"))
    )


def full_4gpu() -> str:
    """The full model on four H200: no offload refused, cpu_adam 50% and state offload on EP4."""
    from calibrate_planner import plan_of

    from offload_runner.config.compose import compose_config, to_run_config
    from offload_runner.model_size import count_parameters

    files = sorted((ROOT / "bench" / "results").glob("results-full-4gpu-*.json"))
    data = {p.name: json.loads(p.read_text()) for p in files}
    runs = {r["case"]["name"]: r for d in data.values() for r in d["results"]}
    oom, s = runs["full EP4 no offload"], runs["full EP4 cpu_adam 50%"]["summary"]
    states = runs["full EP4 optimizer states"]["summary"]
    commit = data["results-full-4gpu-2.json"]["environment"]["commit"]
    model = to_run_config(compose_config(["recipe=qwen3_30b_a3b"])).model
    params = count_parameters(model).total
    return f"""48 layers, 128 experts, {params / 1e9:.1f}B parameters, GBS 16, micro-batch 1, \
sequence 4096, one node of four H200 (64 cores, 512 GB RAM; `bash bench/device_session.sh \
full-4gpu-1` and `full-4gpu-3`). Without offload the job stops with status {oom["status"]} after \
{oom["wall_s"]:.0f} s, exit {oom["returncode"]}, as `--plan` says \
({plan_of(oom).worst.gpu_peak / 2**30:.0f} GB planned per rank on a 139 GB GPU); half of Adam on \
the CPU (the CPU-Adam engine) trains on EP4 and on PP2 x EP2, the loss falling over 20 iterations \
(`python bench/run_benchmarks.py report --suite full-4gpu bench/results/*.json`). \
Optimizer-state offload (`full-4gpu-2`, commit {commit}) trains EP4 too: \
{states["step_time_s_median"]:.2f} s per step against {s["step_time_s_median"]:.2f} s for \
cpu_adam 50%, GPU peak {states["gpu_peak_allocated_gb"]:.1f} GB, loss \
{states["first_loss"]:.2f} -> {states["final_loss"]:.2f}. HybridDeviceOptimizer 50% on the full \
model did not start: the call's time limit came first. Time to first step counts from the \
launcher's start to the last rank's first iteration; on EP4 its largest phase is the optimizer's \
({s["startup_s"]["optimizer"]:.0f} s), which allocates and page-locks the host-side masters and \
states ({s["host_pinned_gb_max"]:.1f} GB pinned per rank). A 48-layer checkpoint would hold \
14 B/param, {params * 14 / 1e9:.0f} GB: more than the machine's 235 GB disk, hence resume below \
at 4 layers."""


PARTS = {
    "full_4gpu": full_4gpu,
    **SHARED_PARTS,
    "tails": tails,
    "verify": verify,
}


if __name__ == "__main__":
    print(fill("gpu-tests.md", PARTS), end="")
