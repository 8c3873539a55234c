"""The command line: Megatron-Bridge's spellings and Hydra's own, one entry point.

    run_recipe.py --recipe qwen3_30b_a3b_pretrain_config optimizer.optimizer_cpu_offload=True ...
    run_recipe.py recipe=qwen3_30b_a3b offload/optimizer=cpu_50 --dry-run
    run_recipe.py -m recipe=tiny optimizer.optimizer_offload_fraction=0,0.5,1 --dry-run

offload-runner's own flags (``--recipe``, ``--dry-run``, ``--plan``, ``--verify``,
``--list-recipes``, ``--collect``, ``--version``) are taken out of the argument list; everything
else goes to Hydra unchanged, so ``--cfg job``, ``--info defaults``,
``-m`` and ``--help`` keep their Hydra meaning.

Exit codes: 0 ok; 1 the run failed, or this machine cannot run it (no CUDA device, Transformer
Engine missing where the job starts); 2 the input is wrong (Hydra's message, or every broken rule
with its fix), with nothing written.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.markup import escape

from offload_runner import console
from offload_runner.auto import choose_offload, largest_slice
from offload_runner.checkpoint import load_problem, save_problem
from offload_runner.config.compose import (
    CONF_DIR,
    RECIPE_SUFFIXES,
    closest_key,
    config_groups,
    normalize_recipe_name,
    recipe_description,
    recipe_paths,
    register_all,
    schema_keys,
    to_run_config,
    unknown_keys,
)
from offload_runner.config.overrides import OverrideError, check_overrides
from offload_runner.config.schema import MIXED_PRECISION_RECIPES, REMOVED_KEYS, RunConfig
from offload_runner.launch import submitit_rendezvous
from offload_runner.offload import any_enabled, apply_runtime_environment, summarize
from offload_runner.plan import GiB, make_plan, planned_gpus_per_node
from offload_runner.progress import on_terminal
from offload_runner.rundir import VERBOSE_ENV, RunDirError, create_run_dir
from offload_runner.step_cost import cost_note, param_count, rate_for_ranks, weight_offload_note
from offload_runner.validation import RULES, Environment, errors, validate, value_violations

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


class Mode(str, Enum):
    train = "train"
    dry_run = "dry_run"
    plan = "plan"
    plan_json = "plan_json"
    plan_largest = "plan_largest"
    dry_run_full = "dry_run_full"  # --dry-run --full: the whole resolved config too
    verify = "verify"


@dataclass
class CliOptions:
    mode: Mode = Mode.train
    list_recipes: bool = False
    version: bool = False
    collect: Path | None = None
    extra_recipes: list[Path] = field(default_factory=list)  # recipe files named by path
    overrides: list[str] = field(default_factory=list)  # the command line's key=value, group=opt


MODE_FLAGS = {"--dry-run": Mode.dry_run, "--plan": Mode.plan, "--verify": Mode.verify}
# Hydra's flags that take the next argument as their value (``--info`` takes one optionally).
HYDRA_VALUE_FLAGS = (
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--shell-completion",
    "-sc",
)
HYDRA_INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


class UsageError(Exception):
    """A mistake on the command line itself (before Hydra sees it), with the fix for it."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


AUTO_MICRO_BATCH = "train.micro_batch_size=auto"  # auto picks it (planner.auto_micro_batch)


def split_argv(argv: Sequence[str]) -> tuple[CliOptions, list[str]]:
    """Take offload-runner's flags out; translate ``--recipe NAME`` into ``recipe=NAME``."""
    options = CliOptions()
    hydra_args: list[str] = []
    hydra_flags: list[str] = []  # Hydra's own flags go first: argparse takes overrides after them
    args = list(argv)
    json_output = largest = full = False
    while args:
        arg = args.pop(0)
        if arg in MODE_FLAGS:
            if options.mode not in (Mode.train, MODE_FLAGS[arg]):
                shown = next(flag for flag, mode in MODE_FLAGS.items() if mode == options.mode)
                raise UsageError(f"{arg} can not be combined with {shown}", "pick one of them")
            options.mode = MODE_FLAGS[arg]
        elif arg == "--json":
            json_output = True
        elif arg == "--largest":
            largest = True
        elif arg == "--full":
            full = True
        elif arg == "--list-recipes":
            options.list_recipes = True
        elif arg == "--version":
            options.version = True
        elif arg == "--verbose":  # library warnings in the terminal too (the ranks inherit it)
            os.environ[VERBOSE_ENV] = "1"
        elif arg == "--collect" or arg.startswith("--collect="):
            value = _option_value(arg, args)
            if not value or not Path(value).is_dir():
                raise UsageError(
                    f"--collect needs a sweep folder, got {value!r}",
                    "pass the folder a multirun printed: --collect multirun/...",
                )
            options.collect = Path(value)
        elif arg == "--recipe" or arg.startswith("--recipe="):
            value = _option_value(arg, args)
            if not value or value.startswith("-"):
                raise UsageError(
                    "--recipe needs a name or a recipe file",
                    "e.g. --recipe qwen3_30b_a3b_proxy; --list-recipes shows them",
                )
            hydra_args.append(f"recipe={_recipe_choice(value, options)}")
        elif arg.startswith("recipe="):
            hydra_args.append(f"recipe={_recipe_choice(arg.partition('=')[2], options)}")
        elif arg.startswith("-"):
            _check_flag(arg)
            hydra_flags.append(arg)
            takes_value = arg in HYDRA_VALUE_FLAGS or (
                arg in ("--info", "-i") and bool(args) and args[0] in HYDRA_INFO_CHOICES
            )
            if takes_value and args:
                hydra_flags.append(args.pop(0))
        elif arg.partition("=")[0].lstrip("+") == "mixed_precision":
            hydra_args += _mixed_precision_recipe(arg.partition("=")[2])
        elif arg == AUTO_MICRO_BATCH:
            hydra_args.append("planner.auto_micro_batch=true")
        else:
            _check_override_key(arg)
            hydra_args.append(arg)
    _check_auto_micro_batch(hydra_args)
    options.overrides = list(hydra_args)
    hydra_args = hydra_flags + hydra_args
    if full:
        if options.mode != Mode.dry_run:
            raise UsageError(
                "--full goes with --dry-run", "python run_recipe.py ... --dry-run --full"
            )
        options.mode = Mode.dry_run_full
    if json_output or largest:
        flag = "--json" if json_output else "--largest"
        if options.mode != Mode.plan or (json_output and largest):
            raise UsageError(
                f"{flag} goes with --plan (alone)", f"python run_recipe.py ... --plan {flag}"
            )
        options.mode = Mode.plan_json if json_output else Mode.plan_largest
    return options, hydra_args


def _check_auto_micro_batch(hydra_args: list[str]) -> None:
    """train.micro_batch_size=auto beside planner.auto_micro_batch=false: refused, not the
    last one winning."""
    forbidden = any(
        a.startswith("planner.auto_micro_batch=") and a.endswith(("false", "False", "0"))
        for a in hydra_args
    )
    if forbidden and "planner.auto_micro_batch=true" in hydra_args:
        raise UsageError(
            f"{AUTO_MICRO_BATCH} asks auto for the micro-batch, planner.auto_micro_batch=false "
            "forbids it",
            "keep one: train.micro_batch_size=auto, or a number with auto_micro_batch=false",
        )


def _mixed_precision_recipe(name: str) -> list[str]:
    """``mixed_precision=bf16_mixed`` (Megatron-Bridge's recipe name) as the keys it sets."""
    if name not in MIXED_PRECISION_RECIPES:
        close = difflib.get_close_matches(name, MIXED_PRECISION_RECIPES, n=1)
        raise UsageError(
            f"unknown mixed_precision recipe {name!r}"
            + (f" (did you mean {close[0]}?)" if close else ""),
            "one of: " + ", ".join(MIXED_PRECISION_RECIPES),
        )
    values = MIXED_PRECISION_RECIPES[name]
    return [f"mixed_precision.{k}={'null' if v is None else v}" for k, v in values.items()]


# Hydra's own flags (those without a value; HYDRA_VALUE_FLAGS take one).
HYDRA_FLAGS = (
    "--help",
    "-h",
    "--hydra-help",
    "--resolve",
    "--run",
    "-r",
    "--multirun",
    "-m",
    "--info",
    "-i",
)
OUR_FLAGS = (
    *MODE_FLAGS,
    "--json",
    "--largest",
    "--full",
    "--list-recipes",
    "--version",
    "--verbose",
    "--collect",
    "--recipe",
    "--prepare",
)


def _check_flag(arg: str) -> None:
    """A flag that is neither ours nor Hydra's: one line naming the closest, not argparse's
    usage block."""
    flag = arg.partition("=")[0]
    known = frozenset((*OUR_FLAGS, *HYDRA_FLAGS, *HYDRA_VALUE_FLAGS))
    if flag in known:
        return
    close = closest_key(flag, known)
    raise UsageError(
        f"unknown flag {flag}" + (f" (did you mean {close}?)" if close else ""),
        f"write {close}" if close else "python run_recipe.py --help lists the flags",
    )


def _check_override_key(arg: str) -> None:
    """``[+|++|~]section.key=value`` must name a schema key (Hydra's ``+`` would add an unknown
    one, saved and then ignored); config groups (``offload/optimizer=...``) and ``hydra.*`` pass."""
    if arg.startswith("-") or "=" not in arg:
        return
    key = arg.partition("=")[0].lstrip("+~")
    groups = config_groups()
    if "/" in key and key not in groups and not key.startswith("hydra/"):
        close = closest_key(key, frozenset(groups))
        raise UsageError(
            f"no config group {key}" + (f" (did you mean {close}?)" if close else ""),
            f"spell it {close}=..." if close else "python run_recipe.py --help lists the groups",
        )
    if "/" in key or key.split(".")[0] in ("hydra", *groups):
        return
    if key not in schema_keys():
        raise UsageError(*_unknown_key_message(key))


def _unknown_key_message(key: str) -> tuple[str, str]:
    if key in REMOVED_KEYS:
        why, fix = REMOVED_KEYS[key]
        return f"{key} was removed: {why}", fix
    close = closest_key(key, schema_keys())
    return (
        f"unknown key {key}" + (f" (did you mean {close}?)" if close else ""),
        f"spell it {close}=..." if close else "python run_recipe.py --help lists the sections",
    )


def _option_value(arg: str, rest: list[str]) -> str:
    """The value of ``--flag=VALUE`` or ``--flag VALUE`` (taken off ``rest``); "" when missing."""
    if "=" in arg:
        return arg.partition("=")[2]
    return rest.pop(0) if rest else ""


def _recipe_choice(value: str, options: CliOptions) -> str:
    """A recipe name, its ``_pretrain_config`` alias, or the path of a recipe YAML of one's own."""
    if value.endswith(RECIPE_SUFFIXES) or "/" in value or _is_dir(value):
        path = _recipe_file(value)
        options.extra_recipes.append(path)
        return path.stem
    name = normalize_recipe_name(value)
    known = recipe_paths(options.extra_recipes)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        shown = value if len(value) <= 80 else f"{value[:60]}... ({len(value)} characters)"
        raise UsageError(
            f"unknown recipe {shown!r}{hint}",
            "--list-recipes shows the recipes; --recipe also takes a .yaml file",
        )
    return name


def _is_dir(value: str) -> bool:
    try:
        return Path(value).is_dir()
    except OSError:  # a name longer than the file system takes
        return False


def _recipe_file(value: str) -> Path:
    """A recipe file that exists, parses, and sets something; else a UsageError saying which."""
    path = Path(value)
    try:
        path.stat()
    except FileNotFoundError:
        pass
    except OSError as err:  # a name too long, a folder we may not enter
        raise UsageError(f"recipe file {value[:80]}: {err.strerror}", "check the path") from None
    if path.is_dir():
        raise UsageError(
            f"--recipe {value} is a folder",
            f"name one recipe file in it (--recipe {value.rstrip('/')}/NAME.yaml) "
            "or a built-in recipe (--list-recipes)",
        )
    if not path.is_file():
        raise UsageError(
            f"recipe file {value} does not exist",
            "check the path, or name a built-in recipe (--list-recipes)",
        )
    if path.suffix not in RECIPE_SUFFIXES:
        raise UsageError(f"recipe file {value} is not a .yaml/.yml file", "rename it NAME.yaml")
    try:
        node = OmegaConf.load(path)
    except Exception as err:  # noqa: BLE001 - yaml's and OmegaConf's parse errors alike
        where = " ".join(str(err).split())[:200]
        raise UsageError(
            f"recipe file {value} is not valid YAML: {where}", "fix the YAML at the line it names"
        ) from None
    if not isinstance(node, DictConfig) or not len(node):
        raise UsageError(
            f"recipe file {value} is empty (it would run the built-in defaults)",
            "a recipe sets keys, e.g. 'defaults: [tiny]' and 'model: {num_layers: 8}'"
            "; recipes/tiny.yaml is an example",
        )
    unknown = unknown_keys(node)
    if unknown:
        message, fix = _unknown_key_message(unknown[0])
        raise UsageError(f"recipe file {value}: {message}", fix)
    if "defaults" in node:
        _check_recipe_defaults(value, node.defaults, path.parent)
    return path.resolve()


def _check_recipe_defaults(value: str, defaults, folder: Path) -> None:
    """A recipe file's defaults list: recipes (of its folder too) and ``/group: option``
    entries that exist, else a UsageError naming the entry (not Hydra's message about the
    recipe group, which names the user's own file)."""
    if not isinstance(defaults, ListConfig):
        raise UsageError(
            f"recipe file {value}: defaults must be a list, not {defaults!r}",
            "write it as a list: 'defaults: [tiny]' or one '- NAME' a line",
        )
    groups = config_groups()
    recipes = [*groups["recipe"], *(p.stem for p in folder.glob("*.y*ml"))]
    for entry in defaults:
        if isinstance(entry, str):
            group, option = "recipe", normalize_recipe_name(entry)
            if entry == "_self_":
                continue
        elif isinstance(entry, DictConfig) and len(entry) == 1:
            ((key, option),) = entry.items()
            group = str(key).removeprefix("override").strip().lstrip("/")
        else:
            raise UsageError(f"recipe file {value}: defaults entry {entry!r}", "write '- NAME'")
        options = recipes if group == "recipe" else groups.get(group)
        if options is None:
            raise UsageError(
                f"recipe file {value}: its defaults name a group {group!r}, which does not exist",
                f"pick one of: {', '.join(g for g in groups if g != 'recipe')}",
            )
        if str(option) not in options:
            raise UsageError(
                f"recipe file {value}: its defaults name {option!r}, not an option of {group}",
                f"pick one of: {', '.join(sorted(options))}",
            )


@dataclass
class _Outcome:
    started: bool = False
    code: int = EXIT_OK


class _Stop(Exception):
    """Ends ``execute`` with an exit code; what to say was said where it was raised."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass
class _Job:
    """What one Hydra job acts on: the composed config, its typed view, how many ranks the plan
    counts, auto's choice, the rule violations found (warnings by the time it acts)."""

    cfg: DictConfig
    run: RunConfig
    mode: Mode
    world: int | None
    auto: str | None = None
    violations: list = field(default_factory=list)


def execute(cfg: DictConfig, mode: Mode, env: Environment | None = None) -> int:
    """Validate a composed config and act on it (the body of every Hydra job)."""
    quiet = (Mode.dry_run, Mode.dry_run_full, Mode.plan, Mode.plan_json, Mode.plan_largest)
    if mode in quiet and not on_terminal():
        return EXIT_OK  # under torchrun, rank 0 alone prints and writes what needs no GPU
    try:
        run = _typed_run(cfg)
        job = _Job(cfg, run, mode, _planned_world(run))
        if mode == Mode.plan_largest:
            return _print_largest(run, job.world)
        _apply_auto(job)
        _validate(job, env)
        return ACTIONS[mode](job)
    except _Stop as stop:
        return stop.code


def _typed_run(cfg: DictConfig) -> RunConfig:
    """The config as a RunConfig (with a Slurm job's rendezvous), its keys known and its values
    in range, its checkpoint to resume from there; else _Stop(2), said."""
    try:
        unknown = unknown_keys(cfg)  # reads every value: a bad ${...} raises here
        if unknown:  # from a recipe file, or added with + on the command line
            console.fail(*_unknown_key_message(unknown[0]))
            raise _Stop(EXIT_USAGE)
        run = to_run_config(cfg)
        rendezvous = submitit_rendezvous(run.launcher)  # a job of hydra/launcher=submitit_*
        if rendezvous:
            if _submitit_tasks_per_node() not in (None, 1):
                console.fail(
                    "hydra.launcher.tasks_per_node must be 1: each node runs one torchrun agent, "
                    "which starts one rank per GPU",
                    "set hydra.launcher.tasks_per_node=1 (and hydra.launcher.gpus_per_node)",
                )
                raise _Stop(EXIT_USAGE)
            for key, value in rendezvous.items():
                OmegaConf.update(cfg, key, value)
            run = to_run_config(cfg)
    except OmegaConfBaseException as err:
        fix = "set the key it names on the command line, or mend the ${...} that names it"
        console.fail(str(err).splitlines()[0], fix)
        raise _Stop(EXIT_USAGE) from None
    ranges = value_violations(run)
    if ranges:  # before the planner, which divides by some of them
        console.print_violations(ranges)
        raise _Stop(EXIT_USAGE)
    c = run.checkpoint
    problem = load_problem(c.load, c.save) or save_problem(c.save)
    if problem:
        console.fail(*problem)
        raise _Stop(EXIT_USAGE)
    return run


def _apply_auto(job: _Job) -> None:
    """offload/*=auto: the planner's choice written into the config (said, and why)."""
    if not job.run.planner.auto:
        return
    try:
        choice = choose_offload(job.run, job.world)
    except ValueError as err:
        console.fail(
            str(err),
            "add GPUs (parallel layout), shorten model.seq_length or train.micro_batch_size, "
            "or set planner.gpu_memory_gb / planner.host_memory_gb",
        )
        raise _Stop(EXIT_USAGE) from None
    for key, value in choice.overrides.items():
        OmegaConf.update(job.cfg, key, value)
    job.run, job.auto = to_run_config(job.cfg), choice.description
    if job.mode != Mode.plan_json:
        console.console.print(f"[bold]auto:[/] {escape(job.auto)}", soft_wrap=True)


def _validate(job: _Job, env: Environment | None) -> None:
    """The rules table and Megatron-Core's checks; errors end the job (2: the input, 1: only
    the machine, e.g. no Transformer Engine where the job starts)."""
    launching = job.mode in (Mode.train, Mode.verify)
    if launching:
        apply_runtime_environment(job.run)  # before Transformer Engine is first imported
    env = env or Environment.detect(launching=launching, world_size=job.world)
    job.violations = validate(job.run, env)
    if errors(job.violations):
        machine = all(v.environment for v in errors(job.violations))
        if launching and machine and not _gpu_visible():  # the GPU first, then its libraries
            raise _Stop(EXIT_FAILED)
        console.print_violations(job.violations)
        raise _Stop(EXIT_FAILED if machine else EXIT_USAGE)


def _plan(job: _Job) -> int:
    """--plan [--json]: the table (or JSON) and the verdict: 0 fits, 1 does not."""
    plan = make_plan(job.run, job.world)
    for note in (cost_note(job.run, plan), weight_offload_note(job.run, plan)):
        if note is not None:
            plan.notes.append(note)
    if job.mode == Mode.plan_json:
        print(json.dumps({**plan.as_dict(), "auto": job.auto}, indent=1))
    else:
        console.print_plan(plan, job.run.name)
    return EXIT_OK if plan.limiting is None else EXIT_FAILED


def _resolved(job: _Job) -> dict:
    return OmegaConf.to_container(job.cfg, resolve=True, enum_to_str=True)


def _launch(job: _Job) -> int:
    """Train (or --verify): on a machine with GPUs and host RAM enough for the plan."""
    run, cfg = job.run, job.cfg
    if job.mode == Mode.verify and not any_enabled(run):
        console.fail(
            "--verify compares a run with offload against one without, and nothing is offloaded",
            "add an offload option, e.g. offload/optimizer=cpu_50 or offload/activation=enabled",
        )
        return EXIT_USAGE
    if not _gpu_visible():
        return EXIT_FAILED
    short = host_ram_short(run, job.world)
    if short:  # page-locked allocations would fail half way in (or the node would swap)
        console.fail(*short)
        return EXIT_USAGE
    _pin_cpu_adam_rate(job)
    run = job.run
    console.print_offload_summary(summarize(run))
    if job.mode == Mode.verify:
        from offload_runner.verify import verify

        run_dir = create_run_dir(
            _run_dir(run.output_dir), _resolved(job), _task_overrides(), unique=_time_stamped(cfg)
        )
        return verify(run, cfg, run_dir, _task_overrides())
    from offload_runner.launch import launch

    return launch(
        run, _resolved(job), _task_overrides(), _run_dir(run.output_dir), _time_stamped(cfg)
    )


def _pin_cpu_adam_rate(job: _Job) -> None:
    """The launcher's CPU Adam rate into the ranks' config (step_cost.rate_for_ranks)."""
    rate = rate_for_ranks(job.run, planned_gpus_per_node(job.run, job.world))
    if rate:
        OmegaConf.update(job.cfg, "planner.cpu_adam_params_per_s", rate)
        job.run = to_run_config(job.cfg)


def _dry_run(job: _Job) -> int:
    """--dry-run: what is offloaded, what the command line changed, whether it fits, the checks;
    the whole resolved config with --full. Saves the config in the run directory."""
    run, cfg, resolved, violations, world = (
        job.run,
        job.cfg,
        _resolved(job),
        job.violations,
        job.world,
    )
    full = job.mode == Mode.dry_run_full
    if full:
        console.print_config_tree(resolved, title=f"recipe {run.name}")
    console.console.print(
        f"[bold]recipe[/] {run.name}; changed on the command line: "
        f"{escape(' '.join(_task_overrides())) or 'nothing'}",
        highlight=False,
    )
    console.print_offload_summary(summarize(run))
    plan = make_plan(run, world)
    verdict = "fits" if plan.limiting is None else f"does not fit ({plan.limiting} runs out first)"
    console.console.print(
        f"[bold]plan[/]: {verdict}: GPU peak {plan.worst.gpu_peak / GiB:.1f} of "
        f"{plan.gpu_capacity_gb:.0f} GB, host {plan.max_node_host_gb:.1f} of "
        f"{plan.host_capacity_gb:.0f} GB per node (--plan for the table)",
        highlight=False,
    )
    console.print_checks(violations, len(RULES))
    run_dir = create_run_dir(
        _run_dir(run.output_dir), resolved, _task_overrides(), unique=_time_stamped(cfg)
    )
    console.console.print(
        f"resolved config saved to [bold]{escape(str(run_dir / 'config.yaml'))}[/]"
        + ("" if full else " (the whole of it: add --full)")
    )
    return EXIT_OK


# What each mode does once the config is composed, auto applied and validated.
ACTIONS = {
    Mode.plan: _plan,
    Mode.plan_json: _plan,
    Mode.dry_run: _dry_run,
    Mode.dry_run_full: _dry_run,
    Mode.train: _launch,
    Mode.verify: _launch,
}


def host_ram_short(run: RunConfig, world: int | None) -> tuple[str, str] | None:
    """The plan needs more host RAM per node than the node has (planner.host_memory_gb, by
    default this machine's): the error and its fix, else None."""
    plan = make_plan(run, world)
    need, have = plan.host_needed_gb, plan.host_capacity_gb
    if need <= have:
        return None
    return (
        f"this run needs {need:.1f} GB of host RAM per node ({plan.margin_gb:g} GB of it "
        f"margin), the node has {have:.0f} GB: its page-locked allocations would fail",
        "offload less or store less (offload/optimizer=auto picks what fits; bf16 moments: "
        "optimizer.exp_avg_dtype=bf16 optimizer.exp_avg_sq_dtype=bf16; a smaller "
        "optimizer.optimizer_state_offload_fraction), or set planner.host_memory_gb to the "
        "RAM of the nodes it runs on",
    )


def _print_largest(run: RunConfig, world: int | None) -> int:
    """--plan --largest: the most layers of the recipe's model that fit here, and how."""
    found = largest_slice(run, world)
    if not found.layers:
        console.fail(
            f"not even {run.model.pipeline_model_parallel_size} layer(s) of {run.name} fit here",
            "add GPUs, offload more (offload/optimizer=auto), "
            "or set planner.gpu_memory_gb / planner.host_memory_gb",
        )
        return EXIT_FAILED
    whole = " (the whole model)" if found.layers == run.model.num_layers else ""
    how = found.choice.description if found.choice else "as configured"
    console.console.print(
        f"[bold]largest:[/] model.num_layers={found.layers}{whole}, "
        f"{param_count(found.params)} params: {escape(how)}"
    )
    console.print_plan(found.plan, run.name)
    return EXIT_OK


def _time_stamped(cfg: DictConfig) -> bool:
    """Whether output_dir is a time-stamped name (the default): two runs started in the same
    second must not share it. A name the user chose is used as it is."""
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    raw = OmegaConf.to_container(cfg, resolve=False).get("output_dir", "")
    return not multirun and "${now:" in str(raw)


def _submitit_tasks_per_node() -> int | None:
    """hydra.launcher.tasks_per_node of a submitit launcher (None for other launchers)."""
    if not HydraConfig.initialized():
        return None
    return OmegaConf.select(HydraConfig.get().launcher, "tasks_per_node", default=None)


def _planned_world(run: RunConfig) -> int | None:
    """Ranks of the job: torchrun's world, or nodes x GPUs per node (None while unknown)."""
    import torch

    from offload_runner.launch import planned_world_size

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return planned_world_size(run.launcher, visible) or None


def _gpu_visible() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    console.fail(
        "no CUDA device is visible on this machine; training needs at least one GPU",
        "run it on a GPU node; --dry-run shows the resolved config, --plan the memory per rank",
    )
    return False


def _run_dir(configured: str) -> str:
    """Multirun jobs write to Hydra's sweep subfolder; single runs to output_dir."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return HydraConfig.get().runtime.output_dir
    return configured


def _task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def version_line() -> str:
    """This project's version and those of the libraries it drives."""
    from offload_runner import __version__, package_version

    libraries = ("hydra-core", "megatron-core", "torch", "transformer-engine")
    return (
        f"offload-runner {__version__} ("
        + ", ".join(f"{name} {package_version(name)}" for name in libraries)
        + ")"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; Ctrl-C anywhere ends it with one line and exit 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        console.err_console.print("interrupted")
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--prepare"]:  # text -> indexed data: its own arguments, no config
        return _prepare(argv[1:])
    if argv[:1] in (["--import-hf"], ["--export-hf"]):  # HF checkpoints in and out
        from offload_runner.hf import command

        return command.main(argv)
    try:
        options, hydra_args = split_argv(argv)
    except UsageError as err:
        console.fail(str(err), err.fix)
        return EXIT_USAGE
    if options.version:
        print(version_line())
        return EXIT_OK
    if options.collect:
        from offload_runner.sweep import collect_and_report

        return collect_and_report(options.collect)
    if options.list_recipes:  # neither needs the schema (Megatron-Core's fields): fast
        paths = recipe_paths(options.extra_recipes)
        console.print_recipes({name: recipe_description(p) for name, p in paths.items()})
        return EXIT_OK
    if hydra_args in (["--help"], ["-h"]):
        print(help_text())
        return EXIT_OK
    register_all(options.extra_recipes)
    try:
        multirun = any(a in ("-m", "--multirun") for a in hydra_args)
        check_overrides(options.overrides, options.extra_recipes, multirun)
    except OverrideError as err:
        console.fail(str(err), err.fix)
        return EXIT_USAGE
    return _run_hydra(options, hydra_args)


def _prepare(argv: list[str]) -> int:
    """``run_recipe.py --prepare ...`` (prepare.py), with a progress bar: 0 written, 2 refused."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from offload_runner import prepare as module
    from offload_runner.prepare import Parser, PrepareError, collect, prepare

    if {"--help", "-h"} & set(argv):
        print(module.__doc__)
        return EXIT_OK
    try:
        args = Parser.parse(argv)
        args.sources = collect(args.inputs)
        total = sum(p.stat().st_size for p in args.sources)
        columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
        with Progress(*columns, console=console.console, transient=True) as bar:
            task = bar.add_task("tokenizing", total=total)
            meta = prepare(args, lambda n: bar.advance(task, n))
    except PrepareError as err:
        console.fail(str(err), err.fix)
        return EXIT_USAGE
    if meta.get("chat"):
        console.console.print(
            f"wrote {args.output}.bin/.idx and its loss mask {args.output}.mask.bin/.idx: "
            f"{meta['documents']} conversations, {meta['tokens']:,} tokens of which "
            f"{meta['trained_tokens']:,} are answers (trained); train with: data=sft "
            f"dataset.data_path=[{args.output}] model.vocab_size={meta['vocab_size']}",
            soft_wrap=True,
            markup=False,
        )
        return EXIT_OK
    what = "trained on the input" if meta["tokenizer_trained"] else f"from {args.tokenizer}"
    if "tokenizer_encoding" in meta:
        what += f" (tiktoken's {meta['tokenizer_encoding']}, known by its size)"
    console.console.print(
        f"wrote {args.output}.bin/.idx: {meta['documents']} documents, {meta['tokens']:,} tokens; "
        f"tokenizer {what} ({meta['vocab_size']} ids, EOD {meta['eod_id']}); train with: "
        f"data=indexed dataset.data_path=[{args.output}] model.vocab_size={meta['vocab_size']}",
        soft_wrap=True,
        markup=False,
    )
    return EXIT_OK


def help_text() -> str:
    """Hydra's --help page from conf/config.yaml's hydra.help template, its groups listed from
    conf/ as Hydra lists them, without composing (the schema imports Megatron-Core: seconds)."""
    help_cfg = OmegaConf.load(CONF_DIR / "config.yaml").hydra.help
    groups = "\n".join(
        f"{group}: {', '.join(options)}" for group, options in sorted(config_groups().items())
    )
    return (
        help_cfg.template.replace("${hydra.help.header}", help_cfg.header)
        .replace("${hydra.help.footer}", help_cfg.footer)
        .replace("$APP_CONFIG_GROUPS", groups + "\n")
    )


def _away_from_slurm(options: CliOptions, hydra_args: list[str]) -> list[str] | None:
    """A Slurm sweep where there is no srun: its --dry-run / --plan jobs only compose and check,
    so they run here (the launcher's arguments dropped); a sweep to submit is said and refused
    (None), before Hydra makes its folder (submitit's own error is a traceback)."""
    import shutil

    if "hydra/launcher=submitit_slurm" not in hydra_args or shutil.which("srun"):
        return hydra_args
    if options.mode in (Mode.train, Mode.verify):
        console.fail(
            "hydra/launcher=submitit_slurm submits through Slurm, and there is no srun here",
            "run it on a Slurm login node, or add --dry-run to check its jobs here",
        )
        return None
    launcher = ("hydra/launcher=", "hydra.launcher.")
    console.console.print("no Slurm here: the sweep's jobs are checked in this process")
    return [a for a in hydra_args if not a.lstrip("+~").startswith(launcher)]


def _run_hydra(options: CliOptions, hydra_args: list[str]) -> int:
    outcome = _Outcome()
    hydra_args = _away_from_slurm(options, hydra_args)
    if hydra_args is None:
        return EXIT_USAGE

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> int:
        outcome.started = True
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            job_cfg = HydraConfig.get().job
            console.console.rule(f"job {job_cfg.num}: {job_cfg.override_dirname or 'defaults'}")
        try:
            code = execute(cfg, options.mode)
        except RunDirError as err:
            console.fail(str(err), err.fix)
            code = EXIT_USAGE
        outcome.code = max(outcome.code, code)
        return code  # a submitit job's result: the parent reads it back (_submitted_jobs_code)

    GlobalHydra.instance().clear()  # a compose() earlier in this process must not linger
    SweepDirRecorder.last = None
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
    sweep_dir = SweepDirRecorder.last
    if sweep_dir and not outcome.started:  # the jobs ran elsewhere (submitit)
        outcome.code = _submitted_jobs_code(sweep_dir)
    kept = sweep_dir and not _remove_if_no_run(Path(sweep_dir))
    if kept and options.mode in (Mode.train, Mode.verify):
        hint = f"python run_recipe.py --collect {sweep_dir}"
        console.console.print(f"sweep done; its table and plot: {hint}")
    return outcome.code


class SweepDirRecorder(Callback):
    """Hydra callback (conf/config.yaml, ``hydra.callbacks``): ``on_multirun_start`` runs in the
    process that launches the sweep, also where the jobs themselves run elsewhere (submitit), and
    records the sweep folder for it."""

    last: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        SweepDirRecorder.last = str(config.hydra.sweep.dir)


def _submitted_jobs_code(sweep_dir: str) -> int:
    """The worst exit code of the jobs a submitit launcher ran, from the results it saved."""
    import pickle

    code = EXIT_OK
    for result in Path(sweep_dir).glob(".submitit/*/*_result.pkl"):
        with result.open("rb") as f:
            state, value = pickle.load(f)
        try:  # a JobReturn; its return_value raises what the job raised
            job_code = value.return_value if state == "success" else EXIT_FAILED
        except Exception:  # noqa: BLE001 - the job itself failed: reported in its own log
            job_code = EXIT_FAILED
        code = max(code, job_code if isinstance(job_code, int) else EXIT_FAILED)
    return code


def _remove_if_no_run(sweep_dir: Path) -> bool:
    """Take back what Hydra made for a sweep none of whose jobs made a run directory (each was
    refused, or --plan): its multirun.yaml and the empty job folders. True if it is gone."""
    if not sweep_dir.is_dir():
        return True
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir()]
    if any(any(job.iterdir()) for job in jobs):
        return False
    for job in jobs:
        job.rmdir()
    (sweep_dir / "multirun.yaml").unlink(missing_ok=True)
    if any(sweep_dir.iterdir()):
        return False
    sweep_dir.rmdir()
    return True
