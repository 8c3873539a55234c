"""Everything the user reads: rich trees and tables on stdout, one-line errors on stderr."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from offload_runner.config.checks import Level, Violation
from offload_runner.offload import OffloadSummary

console = Console()
err_console = Console(stderr=True)


def fail(message: str, fix: str | None = None) -> None:
    """One line saying what is wrong, one saying how to fix it; no traceback."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if fix:
        err_console.print(f"  [bold]fix:[/] {escape(fix)}", highlight=False, soft_wrap=True)


def _add_branch(tree: Tree, node: Mapping[str, Any]) -> None:
    for key, value in node.items():
        if isinstance(value, Mapping):
            _add_branch(tree.add(f"[bold]{key}[/]"), value)
        else:
            text = escape(repr(value) if isinstance(value, str) else str(value))
            tree.add(f"{key}: [cyan]{text}[/]")


def print_config_tree(container: Mapping[str, Any], title: str = "config") -> None:
    tree = Tree(f"[bold]{title}[/]")
    _add_branch(tree, container)
    console.print(tree)


def print_offload_summary(rows: Iterable[OffloadSummary]) -> None:
    """What is offloaded: one paragraph per mechanism that is on (readable at 80 columns), the
    ones that are off in one line."""
    rows = list(rows)
    console.print("[bold]offloaded[/]")
    for row in (r for r in rows if r.enabled):
        note = f" {row.note}." if row.note else ""
        console.print(
            f"  [green]{escape(row.mechanism)}[/] ({escape(row.group)}): "
            f"{escape(row.moves)}.{escape(note)}",
            highlight=False,
        )
    off = [r.mechanism for r in rows if not r.enabled]
    if len(off) == len(rows):
        console.print("  nothing")
    if off:
        console.print(f"  off: {', '.join(off)}", highlight=False)


def print_checks(violations: list[Violation], rules: int) -> None:
    """Which constraints ran (``rules`` rows of the table), and the warnings among them."""
    warned = [v for v in violations if v.level == Level.warning]
    console.print(
        f"[green]checked[/] {rules} offload-runner rules and Megatron-Core's "
        "TransformerConfig / OptimizerConfig / DDP config checks: no errors"
        + (f", {len(warned)} warning(s)" if warned else "")
    )
    for v in warned:  # wrapped to the terminal: a summary, not a log line
        console.print(f"[yellow]warning:[/] {escape(v.message)}", highlight=False)
        console.print(f"  [bold]fix:[/] {escape(v.fix)}", highlight=False)


def print_violations(violations: list[Violation]) -> None:
    """Every error at once, each with its fix (stderr)."""
    errors = [v for v in violations if v.level == Level.error]
    err_console.print(
        f"[bold red]error:[/] the configuration breaks {len(errors)} rule(s); nothing was started",
        highlight=False,
    )
    for v in violations:
        colour = "red" if v.level == Level.error else "yellow"
        err_console.print(
            f"  [{colour}]{v.level.value}:[/] {escape(v.message)}", highlight=False, soft_wrap=True
        )
        err_console.print(f"    [bold]fix:[/] {escape(v.fix)}", highlight=False, soft_wrap=True)


def print_recipes(recipes: Mapping[str, str]) -> None:
    table = Table(title="recipes (--recipe NAME, or NAME_pretrain_config)", title_justify="left")
    table.add_column("name")
    table.add_column("description")
    for name, description in recipes.items():
        table.add_row(name, description)
    console.print(table)


def log_line(text: str) -> None:
    """A line for this rank's log file (rank<N>.log) through the logging module."""
    import logging

    logging.getLogger("offload_runner").info(text)


def print_plan(plan, recipe: str) -> None:  # plan: offload_runner.plan.Plan
    """Components down, one column per pipeline stage (its ranks plan alike), then per-node
    host memory and the verdict."""
    from offload_runner.plan import GiB

    stages: dict[int, list] = {}
    for r in plan.ranks:
        stages.setdefault(r.stage, []).append(r)
    worst = {stage: max(ranks, key=lambda x: x.gpu_peak) for stage, ranks in stages.items()}
    table = Table(
        title=f"memory plan: {recipe} on {len(plan.ranks)} rank(s), GB per rank",
        title_justify="left",
    )
    table.add_column("")
    for stage, ranks in stages.items():
        table.add_column(f"stage {stage}\nranks {_span([x.rank for x in ranks])}", justify="right")
    rows = (
        ("bf16 weights", "weights"),
        ("gradient buffer", "grads"),
        ("fp32 master + Adam (GPU)", "optimizer_gpu"),
        ("... during the step only", "optimizer_step_only"),
        ("activations", "activations"),
        ("... moved by activation offload", "activations_offloaded"),
        ("logits + loss", "logits"),
        ("... or a group rebuilt by recompute", "recomputed"),
        ("workspace", "workspace"),
        ("peak in forward + backward", "fwd_bwd_peak"),
        ("peak in the optimizer step", "step_peak"),
        ("[bold]GPU peak[/]", "gpu_peak"),
        ("host: pinned", "host_pinned"),
        ("host: CPU optimizer", "host_pageable"),
        ("host: the rank's process", "host_process"),
    )
    for label, attribute in rows:
        table.add_row(label, *(f"{getattr(r, attribute) / GiB:.2f}" for r in worst.values()))
    console.print(table)
    nodes = plan.node_host_gb()
    console.print(
        f"host per node: {', '.join(f'node {n} {gb:.1f} GB' for n, gb in nodes.items())} "
        f"of {plan.host_capacity_gb:.0f} GB ({plan.host_capacity_source}); "
        f"GPU {plan.gpu_capacity_gb:.1f} GB "
        f"({plan.gpu_capacity_source}), kept free {plan.gpu_kept_free_gb:.1f} GB"
        + (" (margin + NCCL)" if plan.gpu_kept_free_gb > plan.margin_gb else ""),
        highlight=False,
    )
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    worst = plan.worst.gpu_peak / GiB
    if plan.limiting is None:
        console.print(
            f"[green]fits:[/] peak {worst:.1f} GB on rank {plan.worst.rank}", highlight=False
        )
    else:
        runs_out = "GPU memory" if plan.limiting == "gpu" else "host RAM"
        console.print(
            f"[bold red]does not fit:[/] {runs_out} runs out first (GPU peak {worst:.1f} GB on "
            f"rank {plan.worst.rank}); offload/optimizer=auto picks what fits at the least cost",
            highlight=False,
        )


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
