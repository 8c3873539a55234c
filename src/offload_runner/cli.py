"""The command line: Megatron-Bridge's spellings and Hydra's own, one entry point.

    run_recipe.py --recipe qwen3_30b_a3b_pretrain_config optimizer.optimizer_cpu_offload=True ...
    run_recipe.py recipe=qwen3_30b_a3b offload/optimizer=cpu_50 --dry-run
    run_recipe.py -m recipe=tiny optimizer.optimizer_offload_fraction=0,0.5,1 --dry-run

offload-runner's own flags (``--recipe``, ``--dry-run``, ``--list-recipes``) are taken out of the
argument list; everything else goes to Hydra unchanged, so ``--cfg job``, ``--info defaults``,
``-m`` and ``--help`` keep their Hydra meaning.

Exit codes: 0 ok; 1 the run failed; 2 the input is wrong (Hydra's message, or every broken rule
with its fix), with nothing written.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from offload_runner import console
from offload_runner.config.compose import (
    CONF_DIR,
    normalize_recipe_name,
    recipe_description,
    recipe_paths,
    register_all,
    to_run_config,
)
from offload_runner.config.schema import RunConfig
from offload_runner.offload import apply_runtime_environment, summarize
from offload_runner.rundir import create_run_dir
from offload_runner.validation import Environment, errors, validate

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class Mode(str, Enum):
    train = "train"
    dry_run = "dry_run"


@dataclass
class CliOptions:
    mode: Mode = Mode.train
    list_recipes: bool = False
    extra_recipe_dirs: list[Path] = field(default_factory=list)


class UsageError(Exception):
    """A mistake on the command line itself (before Hydra sees it)."""


def split_argv(argv: Sequence[str]) -> tuple[CliOptions, list[str]]:
    """Take offload-runner's flags out; translate ``--recipe NAME`` into ``recipe=NAME``."""
    options = CliOptions()
    hydra_args: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--dry-run":
            options.mode = Mode.dry_run
        elif arg == "--list-recipes":
            options.list_recipes = True
        elif arg == "--recipe" or arg.startswith("--recipe="):
            value = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            if not value or value.startswith("-"):
                raise UsageError("--recipe needs a name, e.g. --recipe qwen3_30b_a3b_proxy")
            hydra_args.append(f"recipe={_recipe_choice(value, options)}")
        elif arg.startswith("recipe="):
            hydra_args.append(f"recipe={_recipe_choice(arg.partition('=')[2], options)}")
        else:
            hydra_args.append(arg)
    return options, hydra_args


def _recipe_choice(value: str, options: CliOptions) -> str:
    """A recipe name, its ``_pretrain_config`` alias, or the path of a recipe YAML of one's own."""
    if value.endswith((".yaml", ".yml")):
        path = Path(value)
        if not path.is_file():
            raise UsageError(f"recipe file {value} does not exist")
        options.extra_recipe_dirs.append(path.resolve().parent)
        return path.stem
    return normalize_recipe_name(value)


@dataclass
class _Outcome:
    started: bool = False
    code: int = EXIT_OK


def execute(cfg: DictConfig, mode: Mode, env: Environment | None = None) -> int:
    """Validate a composed config and act on it (the body of every Hydra job)."""
    try:
        run = to_run_config(cfg)
    except OmegaConfBaseException as err:
        console.fail(str(err).splitlines()[0], "set the key it names on the command line")
        return EXIT_USAGE
    if mode == Mode.train:
        apply_runtime_environment(run)  # before Transformer Engine is first imported
    env = env or Environment.detect(launching=mode == Mode.train)
    violations = validate(run, env)
    if errors(violations):
        console.print_violations(violations)
        return EXIT_USAGE

    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if mode == Mode.dry_run:
        console.print_config_tree(resolved, title=f"recipe {run.name}")
        console.print_offload_summary(summarize(run))
        console.print_checks(violations)
        run_dir = create_run_dir(_run_dir(run.output_dir), resolved, _task_overrides())
        console.console.print(f"resolved config saved to [bold]{run_dir / 'config.yaml'}[/]")
        return EXIT_OK

    return _train(run, resolved)


def _train(run: RunConfig, resolved: dict) -> int:
    """Check the GPUs and the world size they give, then hand over to the launcher."""
    import torch

    from offload_runner.launch import in_torchrun, launch, planned_world_size

    if not in_torchrun() and not torch.cuda.is_available():
        console.fail(
            "no CUDA device is visible on this machine; training needs at least one GPU",
            "run it on a GPU node, or add --dry-run to see the resolved config and offload plan",
        )
        return EXIT_FAILED
    world = planned_world_size(run.launcher, torch.cuda.device_count())
    violations = validate(run, Environment.detect(launching=True, world_size=world))
    if errors(violations):
        console.print_violations(violations)
        return EXIT_USAGE
    console.print_offload_summary(summarize(run))
    return launch(run, resolved, _task_overrides())


def _run_dir(configured: str) -> str:
    """Multirun jobs write to Hydra's sweep subfolder; single runs to output_dir."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return HydraConfig.get().runtime.output_dir
    return configured


def _task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options, hydra_args = split_argv(argv)
    except UsageError as err:
        console.fail(str(err), "run_recipe.py --list-recipes shows the recipes")
        return EXIT_USAGE
    register_all(options.extra_recipe_dirs)
    if options.list_recipes:
        paths = recipe_paths(options.extra_recipe_dirs)
        console.print_recipes({name: recipe_description(p) for name, p in paths.items()})
        return EXIT_OK
    return _run_hydra(options, hydra_args)


def _run_hydra(options: CliOptions, hydra_args: list[str]) -> int:
    outcome = _Outcome()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> None:
        outcome.started = True
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            job_cfg = HydraConfig.get().job
            console.console.rule(f"job {job_cfg.num}: {job_cfg.override_dirname or 'defaults'}")
        outcome.code = max(outcome.code, execute(cfg, options.mode))

    GlobalHydra.instance().clear()  # a compose() earlier in this process must not linger
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "run_recipe.py", *hydra_args]
    try:
        job()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else EXIT_FAILED
        # Hydra exits 1 for a bad override or a config error it found while composing.
        return EXIT_USAGE if code == 1 and not outcome.started else code
    finally:
        sys.argv = saved_argv
    return outcome.code
