"""Everything the user reads: rich trees and tables on stdout, one-line errors on stderr."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from offload_runner.offload import OffloadSummary
from offload_runner.validation import RULES, Level, Violation

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
    table = Table(title="offload summary", title_justify="left")
    table.add_column("mechanism", no_wrap=True)
    table.add_column("selected by", no_wrap=True)
    table.add_column("on", no_wrap=True)
    table.add_column("what moves to the CPU")
    table.add_column("note")
    for row in rows:
        table.add_row(
            row.mechanism,
            row.group,
            "[green]yes[/]" if row.enabled else "no",
            escape(row.moves),
            escape(row.note),
        )
    console.print(table)


def print_checks(violations: list[Violation]) -> None:
    """Which constraints ran, and the warnings among them."""
    warned = [v for v in violations if v.level == Level.warning]
    console.print(
        f"[green]checked[/] {len(RULES)} offload-runner rules and Megatron-Core's "
        "TransformerConfig / OptimizerConfig / DDP config checks: no errors"
        + (f", {len(warned)} warning(s)" if warned else "")
    )
    for v in warned:
        console.print(f"[yellow]warning:[/] {escape(v.message)}", highlight=False, soft_wrap=True)
        console.print(f"  [bold]fix:[/] {escape(v.fix)}", highlight=False, soft_wrap=True)


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
