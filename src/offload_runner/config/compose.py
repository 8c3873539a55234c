"""Where the configs live, the recipe group, and composition through Hydra's compose API.

Recipes sit in the top-level ``recipes/`` folder (one YAML each) and are offered to Hydra as the
config group ``recipe`` through the ConfigStore, so ``recipe=NAME`` and a recipe's defaults list
(``override /offload/optimizer: cpu_50``) work like any other group.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from offload_runner.config.megatron_fields import run_schema
from offload_runner.config.schema import RunConfig

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _data_dir(name: str) -> Path:
    """``conf`` or ``recipes``: under $OFFLOAD_RUNNER_ROOT if set, else the copy an installed wheel
    carries (``offload_runner/_conf``, ``_recipes``), else the checkout's top-level folder."""
    if "OFFLOAD_RUNNER_ROOT" in os.environ:
        return Path(os.environ["OFFLOAD_RUNNER_ROOT"]) / name
    packaged = PACKAGE_DIR / f"_{name}"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parents[1] / name


CONF_DIR = _data_dir("conf")
RECIPES_DIR = _data_dir("recipes")
RECIPE_ALIAS_SUFFIX = "_pretrain_config"  # Megatron-Bridge's recipe function names
OFFLOAD_GROUPS = ("offload/activation", "offload/weight", "offload/optimizer")


RECIPE_SUFFIXES = (".yaml", ".yml")


def recipe_paths(extra: Sequence[Path] = ()) -> dict[str, Path]:
    """Recipe name -> YAML file, from recipes/ and ``extra`` (recipe files, or folders of them;
    later ones win). A recipe file named on the command line comes alone, not with its folder."""
    found: dict[str, Path] = {}
    for source in (RECIPES_DIR, *map(Path, extra)):
        files = (
            [source]
            if source.is_file()
            else sorted(p for p in source.glob("*") if p.suffix in RECIPE_SUFFIXES)
        )
        for path in files:
            found[path.stem] = path
    return found


def recipe_description(path: Path) -> str:
    """The first comment line after the package header: a recipe's one-line summary."""
    for line in path.read_text().splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text and not text.startswith("@package"):
            return text
    return ""


# Megatron-Bridge's fine-tuning recipe functions: NAME_sft_config (NAME_finetune_config before)
SFT_ALIAS_SUFFIXES = ("_sft_config", "_finetune_config")


def normalize_recipe_name(name: str) -> str:
    """Accept Megatron-Bridge's ``NAME_pretrain_config`` spelling for ``NAME`` and its
    ``NAME_sft_config`` for ``NAME_sft``."""
    for suffix in SFT_ALIAS_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + "_sft"
    return name.removesuffix(RECIPE_ALIAS_SUFFIX)


_registered: dict[str, list] = {}  # the files the recipe group was last registered from


def register_recipes(extra: Sequence[Path] = ()) -> None:
    """Offer every recipe YAML to Hydra as an option of the ``recipe`` group (package _global_);
    again only where the files (or their modification times) changed since the last call."""
    paths = recipe_paths(extra)
    key = [(name, path, path.stat().st_mtime_ns) for name, path in paths.items()]
    if _registered.get("recipes") == key:
        return
    store = ConfigStore.instance()
    store.repo.pop("recipe", None)  # forget recipes of an earlier call in this process
    for name, path in paths.items():
        store.store(group="recipe", name=name, node=OmegaConf.load(path), package="_global_")
    _registered["recipes"] = key


@cache
def register_configs() -> None:
    """Register the schema (with the installed Megatron-Core's fields) for conf/config.yaml's
    defaults list, once a process (structuring it takes a quarter of a compose)."""
    ConfigStore.instance().store(name="run_schema", node=run_schema())


def register_all(extra_recipe_dirs: Sequence[Path] = ()) -> None:
    register_configs()
    register_recipes(extra_recipe_dirs)


def group_options(group: str) -> list[str]:
    """The options of a config group under conf/ (e.g. offload/optimizer -> cpu_25, ...)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def config_groups() -> dict[str, list[str]]:
    """Every group in conf/ with its options, plus the recipe group."""
    groups = {
        str(p.relative_to(CONF_DIR)): group_options(str(p.relative_to(CONF_DIR)))
        for p in sorted(CONF_DIR.rglob("*"))
        if p.is_dir() and any(p.glob("*.yaml"))
    }
    groups["recipe"] = sorted(recipe_paths())
    return groups


def compose_config(
    overrides: Sequence[str] = (),
    return_hydra_config: bool = False,
    extra_recipe_dirs: Sequence[Path] = (),
) -> DictConfig:
    """Compose a run config with Hydra's compose API (tests, verify, sweeps reuse this)."""
    register_all(extra_recipe_dirs)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="compose"):
        return compose(
            config_name="config",
            overrides=list(overrides),
            return_hydra_config=return_hydra_config,
        )


@cache
def schema_keys() -> frozenset[str]:
    """Every dotted key of the schema (``optimizer.lr``, ...); a list or dict field is a leaf."""

    def keys_of(node: type, prefix: str) -> Iterator[str]:
        for f in dataclasses.fields(node):
            yield prefix + f.name
            nested = f.default_factory
            if isinstance(nested, type) and dataclasses.is_dataclass(nested):
                yield from keys_of(nested, f"{prefix}{f.name}.")

    return frozenset(keys_of(run_schema(), ""))


def closest_key(key: str, known: frozenset[str]) -> str | None:
    """The schema key a misspelt one most likely meant (same section first)."""
    section = key.rpartition(".")[0]
    same = [k for k in known if k.rpartition(".")[0] == section]
    found = difflib.get_close_matches(key, same or known, n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys of a config (composed, or one recipe file) that the schema does not have, such as
    those added with ``+`` on the command line, which Hydra allows: they would be saved and
    silently ignored."""
    known = schema_keys()

    def walk(node: DictConfig, prefix: str) -> list[str]:
        found = []
        for key in node:
            full = f"{prefix}{key}"
            if prefix == "" and key in ("hydra", "defaults"):
                continue
            if full not in known:
                found.append(full)
            elif isinstance(node[key], DictConfig) and any(k.startswith(f"{full}.") for k in known):
                found += walk(node[key], f"{full}.")
        return found

    return walk(cfg, "")


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The typed dataclass view of a composed config (interpolations resolved)."""
    body = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    return OmegaConf.to_object(body)  # type: ignore[return-value]
