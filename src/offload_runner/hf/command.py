"""``--import-hf`` and ``--export-hf`` on the command line: arguments, a progress bar, one line
of what was done (0), or one line and a fix (2)."""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

from offload_runner import console
from offload_runner.hf.families import HfError

USAGE = {
    "--import-hf": "python run_recipe.py --import-hf HF_DIR --output CKPT_DIR [--recipe NAME]",
    "--export-hf": "python run_recipe.py --export-hf CKPT_DIR --output HF_DIR",
}


def parse(argv: list[str]) -> argparse.Namespace:
    flag = argv[0]

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # noqa: ANN201 - argparse's hook
            raise HfError(f"{flag}: {message}", USAGE[flag])

    parser = Parser(prog=f"run_recipe.py {flag}", add_help=False)
    parser.add_argument("source", type=Path)
    parser.add_argument("--output", required=True, type=Path)
    if flag == "--import-hf":
        parser.add_argument("--recipe")
    return parser.parse_args(argv[1:])


def main(argv: list[str]) -> int:
    """Import or export as ``argv[0]`` says."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    flag = argv[0]
    if {"--help", "-h"} & set(argv):
        print(f"usage: {USAGE[flag]}")
        return 0
    try:
        args = parse(argv)
        with (
            _quiet(),
            Progress(
                "{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console.console,
                transient=True,
            ) as bar,
        ):
            done = _import(args, bar) if flag == "--import-hf" else _export(args, bar)
    except HfError as err:
        console.fail(str(err), err.fix)
        return 2
    console.console.print(done, soft_wrap=True, markup=False, highlight=False)
    return 0


def _import(args: argparse.Namespace, bar) -> str:
    from offload_runner.hf.convert import import_hf

    task = bar.add_task("importing tensors", total=None)
    got = import_hf(args.source, args.output, args.recipe, _advancing(bar, task))
    return (
        f"imported {got['family']}: {got['params'] / 1e9:.2f}B params, {got['tensors']} tensors "
        f"({got['bytes'] / 1e9:.1f} GB {got['dtype']}) in {got['seconds']:.0f} s, peak host RAM "
        f"{got['peak_host_gb']:.1f} GB; train from it: python run_recipe.py --recipe "
        f"{args.output}/recipe.yaml"
    )


def _export(args: argparse.Namespace, bar) -> str:
    from offload_runner.hf.convert import export_hf

    task = bar.add_task("exporting layers", total=None)
    got = export_hf(args.source, args.output, _advancing(bar, task))
    return (
        f"exported {got['family']}: {got['tensors']} tensors ({got['bytes'] / 1e9:.1f} GB "
        f"{got['dtype']}) in {got['shards']} shard(s) to {args.output} in {got['seconds']:.0f} s, "
        f"peak host RAM {got['peak_host_gb']:.1f} GB; load it with "
        f"transformers.AutoModelForCausalLM.from_pretrained('{args.output}')"
    )


def _advancing(bar, task):
    return lambda n, total: bar.update(task, advance=n, total=total)


class _quiet:
    """Library warnings (Megatron-Core's, transformers') off the terminal, as for training."""

    def __enter__(self) -> None:
        self.catch = warnings.catch_warnings()
        self.catch.__enter__()
        warnings.simplefilter("ignore")
        self.level = logging.root.manager.disable
        logging.disable(logging.WARNING)

    def __exit__(self, *exc) -> None:
        logging.disable(self.level)
        self.catch.__exit__(*exc)
