"""The command line's overrides checked before Hydra runs, so that what Hydra would refuse is
said in our form (one line, a fix, exit 2) and nothing is written: its grammar, a config group
given twice, a group option that does not exist, a value of the wrong type.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_runner.config.compose import compose_config, config_groups


class OverrideError(ValueError):
    """An override Hydra would refuse: ``str(err)`` says what, ``fix`` how."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


GRAMMAR_FIX = (
    "write key=value (e.g. train.train_iters=20), group=option (e.g. offload/optimizer=states) "
    "or +new.key=value; quote values with spaces or special characters"
)


def check_overrides(
    overrides: Sequence[str], extra_recipe_dirs: Sequence = (), multirun: bool = False
) -> None:
    """Raise OverrideError for the first override Hydra would refuse. A sweep (``-m a=1,2``) is
    checked value by value, and refused without ``multirun``; ``hydra.*`` and ``hydra/*``
    overrides are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    ours = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    parser = OverridesParser.create()
    parsed = []
    for line in ours:
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as err:
            reason = str(err).splitlines()[1] if len(str(err).splitlines()) > 1 else str(err)
            raise OverrideError(
                f"can not read the override {line!r}: {reason}", GRAMMAR_FIX
            ) from None
    _refuse_group_twice(parsed)
    if not multirun:
        _refuse_sweep(parsed)
    values = [
        list(p.sweep_string_iterator()) if p.is_sweep_override() else [p.input_line] for p in parsed
    ]
    values = [[_as_line(p, v) for v in vs] for p, vs in zip(parsed, values, strict=True)]
    first = [vs[0] for vs in values]
    trials = [first] + [
        first[:i] + [v] + first[i + 1 :] for i, vs in enumerate(values) for v in vs[1:]
    ]
    for trial in trials:
        _compose(trial, extra_recipe_dirs)


def _as_line(parsed, value: str) -> str:
    """One value of a (sweep) override as an override line of its own."""
    if not parsed.is_sweep_override():
        return value
    return f"{parsed.get_key_element()}={value}"


def _refuse_sweep(parsed) -> None:
    """A comma-separated value without -m: Hydra's multi-line 'Ambiguous value', in one."""
    sweep = next((p for p in parsed if p.is_sweep_override()), None)
    if sweep is not None:
        key = sweep.get_key_element()
        value = sweep.input_line.partition("=")[2]
        raise OverrideError(
            f"{sweep.input_line} is several values",
            f"quote one value ({key}='{value}'), write a list ({key}=[{value}]) or sweep "
            "them with -m",
        )


def _refuse_group_twice(parsed) -> None:
    groups = config_groups()
    seen: dict[str, str] = {}
    for p in parsed:
        key = p.key_or_group
        if key not in groups or p.is_sweep_override():
            continue
        value = p.value()
        if key in seen and seen[key] != value:
            raise OverrideError(
                f"{key} is given twice: {key}={seen[key]} and {key}={value}",
                "keep one of them (the last would silently win)",
            )
        seen[key] = value


def _compose(lines: list[str], extra_recipe_dirs: Sequence) -> None:
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    try:
        compose_config(lines, extra_recipe_dirs=extra_recipe_dirs)
    except MissingConfigException as err:
        raise _missing_option(err, lines) from None
    except (HydraException, OmegaConfBaseException) as err:
        raise _merge_error(err) from None


def _missing_option(err, lines: list[str]) -> OverrideError:
    groups = config_groups()
    for line in lines:
        group, _, option = line.lstrip("+~").partition("=")
        if group in groups and option not in groups[group]:
            return OverrideError(
                f"{group} has no option {option!r}", f"pick one of: {', '.join(groups[group])}"
            )
    first = str(err).splitlines()[0]
    return OverrideError(first, "python run_recipe.py --help lists the groups and their options")


def _merge_error(err) -> OverrideError:
    """Hydra's 'Error merging override K=V' / OmegaConf's type error, in one line."""
    chained = f"{err}\n{err.__cause__}" if err.__cause__ is not None else str(err)
    text = [line.strip() for line in chained.splitlines() if line.strip()]
    key = next(
        (line.partition(":")[2].strip() for line in text if line.startswith("full_key")), None
    )
    what = text[0].removeprefix("Error merging override ")
    reason = text[1] if len(text) > 1 and not text[1].startswith("full_key") else ""
    message = f"{what}: {reason}" if reason else what
    fix = (
        f"give {key} a value of its type (python run_recipe.py --recipe NAME --cfg job shows "
        f"the resolved config)"
        if key
        else "check the override it names"
    )
    if "expected one of" in reason:
        fix = f"use {reason.partition('expected ')[2]}"
    return OverrideError(message, fix)
