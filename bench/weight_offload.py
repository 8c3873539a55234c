#!/usr/bin/env python
"""Weight offload: each run beside the same run with its weights on the GPU (or, under a GPU
memory cap, beside the capped run without weight offload, which ran out of memory), against
the link's bound for what it moves.

    python bench/weight_offload.py bench/results/results-weight-offload*.json \\
        --plot docs/benchmarks/weight-offload.png > docs/benchmarks/weight-offload.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import fill  # noqa: E402
from plots import commands_block, pyplot, report_main, save  # noqa: E402

from offload_runner.config.compose import compose_config, to_run_config  # noqa: E402
from offload_runner.report import markdown_table  # noqa: E402
from offload_runner.step_cost import (  # noqa: E402
    weight_offload_link_bytes,
    weight_offload_sum_bytes,
    weight_offload_update_bytes,
)

COLUMNS = "step,vs,fwd_bwd,peak,peak_vs"  # fill.COLUMNS


def load(files: list[Path]) -> list[dict]:
    """Every run of the files, with its call's environment and suite."""
    return [
        {**r, "environment": d["environment"], "suite": d["suite"]}
        for path in sorted(files)
        for d in [json.loads(path.read_text())]
        for r in d["results"]
    ]


def bound_lines(results: list[dict], by_name: dict[str, dict]) -> list[str]:
    """For each weight-offload case: its overhead against its baseline beside the link bound
    (step_cost.weight_offload_link_bytes: both directions at once at planner.host_link_gb_per_s)."""
    lines = []
    for r in results:
        s = r["summary"]
        base = by_name.get(r["case"]["baseline"], {}).get("summary") or {}
        if r["status"] != "ok" or not s.get("weight_offload_params") or not base:
            continue
        run = to_run_config(
            compose_config([f"recipe={r['case']['recipe']}", *r["case"]["overrides"]])
        )
        up, down = weight_offload_link_bytes(run, s["weight_offload_params"])
        bound = max(up, down) / (run.planner.host_link_gb_per_s * 1e9)
        overhead = s["step_time_s_median"] - base["step_time_s_median"]
        sums = weight_offload_sum_bytes(run, s["weight_offload_params"])
        least = max(up - sums, down) / (run.planner.host_link_gb_per_s * 1e9)
        lines.append(
            f"- {r['case']['name']}: {s['weight_offload_params'] / 1e9:.2f}B params on "
            f"the host, {up / 1e9:.1f} GB up and {down / 1e9:.1f} GB down per step: link "
            f"bound {bound * 1000:.0f} ms ({least * 1000:.0f} ms without the gradients' sums "
            f"coming back up); overhead {overhead * 1000:.0f} ms ({overhead / bound:.2f}x the "
            f"bound, {overhead / least:.2f}x the one without the sums)"
        )
        # bf16 weights + DDP's gradients
        held = s["weight_offload_params"] * (2 + run.precision.grad_bytes) / 1024**3
        drop = base["gpu_peak_allocated_gb"] - s["gpu_peak_allocated_gb"]
        lines.append(
            f"  - GPU peak {base['gpu_peak_allocated_gb']:.2f} -> "
            f"{s['gpu_peak_allocated_gb']:.2f} GB: {drop:.2f} GB less, {drop / held:.3f}x "
            f"the offloaded layers' weights and gradients ({held:.2f} GB)"
        )
        if "weight_offload_up_gb" in s:  # what the engine counted, less the update's
            update, _ = weight_offload_update_bytes(run, s["weight_offload_params"])
            moved = s["weight_offload_up_gb"] * 1e9 - update
            ahead = moved / (run.planner.host_link_gb_per_s * 1e9)
            extra = s["fwd_bwd_time_s_median"] - base["fwd_bwd_time_s_median"]
            lines.append(
                f"  - forward+backward alone: {moved / 1e9:.1f} GB up (weights, the "
                f"gradients' sums; counted by the engine): {ahead * 1000:.0f} ms at the link; "
                f"forward+backward {extra * 1000:.0f} ms over the baseline's "
                f"({extra / ahead:.2f}x)"
            )
    if lines:
        lines = [
            "",
            "Weight offload against its link bound (all it moves, the offloaded "
            "params' states included, which the baseline's state offload moves too; vs "
            "the same run with its weights on the GPU):",
            "",
            *lines,
        ]
    return lines


def llama3_losses() -> list[str]:
    """llama3_8b under a 48 GB cap with weight offload beside the same line uncapped without
    it: their losses per iteration."""

    def runs(name: str) -> tuple[dict, dict]:
        data = json.loads((ROOT / f"bench/results/results-{name}.json").read_text())
        return data["environment"], {r["case"]["name"]: r["summary"] for r in data["results"]}

    env, capped = runs("weight-offload-caps")
    ref_env, ref = runs("weight-offload-caps-reference")
    a = capped["llama3_8b under 48 GB, weights of 31 layers"]
    b = ref["llama3_8b uncapped, no weight offload"]
    iterations = [str(i + 1) for i in range(len(a["losses"]))]
    rows = [
        [name, *(f"{x:.2f}" for x in s["losses"])]
        for name, s in (("weights offloaded, 48 GB cap", a), ("uncapped, no weight offload", b))
    ]
    return [
        "## llama3_8b under a 48 GB cap: its losses beside the same line uncapped\n",
        f"Suite `weight-offload-caps` ({env['gpu']}, commit {env['commit']}) trained llama3_8b at "
        "seq 8192 under a 48 GB cap with weights of 31 layers, gradients, optimizer state and "
        f"activations offloaded ({a['step_time_s_median']:.1f} s a step, peak "
        f"{a['gpu_peak_allocated_gb']:.1f} GB); suite `weight-offload-caps-reference` "
        f"({ref_env['gpu']}, commit {ref_env['commit']}) ran the same line without the cap and "
        "without weight offload, every state on the host "
        f"({b['step_time_s_median']:.1f} s, peak {b['gpu_peak_allocated_gb']:.1f} GB). Their "
        "losses per iteration (the mock data's rise after iteration 5 is the recipe's, in both):",
        "",
        *markdown_table(["iteration", *iterations], rows),
        "",
    ]


def render(files: list[Path], plot: Path | None) -> str:
    results = load(files)
    by_name = {r["case"]["name"]: r for r in results}
    envs = {(r["environment"]["gpu"], r["environment"]["megatron.core"]) for r in results}
    lines = [
        "# Weight offload",
        "",
        "`offload/weight=enabled model.cpu_offloading_num_layers=N` (beside state offload): the "
        "first N layers' weights, gradients, masters and moments on the host, their modules' "
        "weights streamed through a GPU ring for forward and backward. "
        + "; ".join(f"{gpu}, megatron-core {mcore}" for gpu, mcore in sorted(envs))
        + f"; {', '.join(sorted(f.name for f in files))}.",
        "",
        "## The runs\n",
        fill.table(
            f"{','.join(str(f.resolve().relative_to(ROOT)) for f in sorted(files))}|.|{COLUMNS}"
        ),
        *bound_lines(results, by_name),
        "",
        *llama3_losses(),
    ]
    if plot is not None:
        draw(results, plot)
        lines += [f"![GPU peak and step beside the baseline]({plot.name})", ""]
    commands = {r["case"]["name"]: " ".join(r["command"]) for r in results}
    return "\n".join([*lines, commands_block(commands)])


def draw(results: list[dict], out: Path) -> None:
    """Each weight-offload run's GPU peak and step beside its baseline's."""
    plt = pyplot()
    by_name = {r["case"]["name"]: r for r in results}
    pairs = [
        (r, by_name[r["case"]["baseline"]])
        for r in results
        if r["status"] == "ok"
        and r["case"]["baseline"] != r["case"]["name"]
        and r["case"]["baseline"] in by_name
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.6 * len(pairs) + 1.6), sharey=True)
    y = list(range(len(pairs)))
    for ax, key, what in (
        (axes[0], "gpu_peak_allocated_gb", "GPU peak GB"),
        (axes[1], "step_time_s_median", "step s"),
    ):
        base = [(b["summary"] or {}).get(key, 0) for _, b in pairs]  # 0: it ran out of memory
        ax.barh([i - 0.2 for i in y], base, height=0.4, label="baseline (0: out of memory)")
        ours = [r["summary"][key] for r, _ in pairs]
        ax.barh([i + 0.2 for i in y], ours, height=0.4, label="with weight offload")
        ax.set(xlabel=what)
    axes[0].set_yticks(y, [r["case"]["name"] for r, _ in pairs], fontsize=7)
    axes[0].legend(fontsize=7)
    save(fig, out)


if __name__ == "__main__":
    sys.exit(report_main(__doc__, render))
