"""Read Megatron-Bridge's GPT and MoE pretraining recipes and write the keys they set, with values.

    pip download megatron-bridge==0.6.2 --no-deps --only-binary=:all: --python-version 3.12 \
        -d /tmp/mb
    python tools/bridge_recipe_keys.py /tmp/mb/megatron_bridge-0.6.2-py3-none-any.whl

writes tests/data/bridge_recipe_keys.json, which tests/test_bridge_keys.py composes. The recipes
are read as source (``ast``), never imported: Megatron-Bridge is not a dependency. What counts:

- the ``ConfigContainer(...)`` of ``_pretrain_common`` (``section=SectionConfig(key=value)``) and
  the optimizer/scheduler helper it calls, with the values it passes;
- every ``cfg.section.key = value`` in a ``*pretrain*`` function of the GPT and MoE families;
- ``cfg.mixed_precision = bf16_mixed()`` becomes ``mixed_precision=bf16_mixed``.

A value that is not a literal (a call, a variable) is kept as ``null`` with ``literal: false``;
``torch.bfloat16`` / ``torch.float32`` become ``bf16`` / ``fp32`` (Bridge's own string form).
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

FAMILIES = ("llama", "qwen", "gpt", "deepseek", "gpt_oss", "olmoe", "moonlight", "glm")
FAMILY_FILES = ("qwen2.py", "qwen3.py", "qwen3_moe.py")  # of qwen: the text models
COMMON = "megatron/bridge/recipes/common.py"
OPTIMIZER_HELPERS = "megatron/bridge/recipes/utils/optimizer_utils.py"
# Not training keys: deployment, environment, the HF model a recipe converts from.
SKIPPED_SECTIONS = (
    "comm_overlap",
    "env_vars",
    "dist",
    "ft",
    "peft",
    "inprocess_restart",
    "nvrx_straggler",
)
TORCH_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "bridge_recipe_keys.json"


def value_of(node: ast.expr) -> tuple[object, bool]:
    """(value, is_literal) of an assigned expression."""
    dotted_name = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    if dotted_name and node.value.id == "torch" and node.attr in TORCH_DTYPES:
        return TORCH_DTYPES[node.attr], True
    bare_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
    if bare_call and node.func.id.endswith("_mixed"):  # bf16_mixed(): Bridge's precision recipe
        return node.func.id, True
    try:
        return ast.literal_eval(node), True
    except ValueError:
        return None, False


def dotted(node: ast.expr) -> list[str] | None:
    """``cfg.a.b`` -> ["a", "b"]; None unless it starts at the name ``cfg``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    return parts if isinstance(node, ast.Name) and node.id == "cfg" else None


def recipe_assignments(tree: ast.Module) -> Iterator[tuple[str, object, bool]]:
    """``cfg.section.key = value`` inside every ``*pretrain*`` function of a module."""
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or "pretrain" not in fn.name:
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                parts = dotted(target)
                if parts == ["mixed_precision"]:
                    yield "mixed_precision", *value_of(node.value)
                elif parts and len(parts) == 2:
                    yield ".".join(parts), *value_of(node.value)


def call_keywords(call: ast.Call, section: str) -> Iterator[tuple[str, object, bool]]:
    for kw in call.keywords:
        if kw.arg:
            yield f"{section}.{kw.arg}", *value_of(kw.value)


def common_assignments(common: ast.Module, helpers: ast.Module) -> Iterator[tuple]:
    """The ConfigContainer of ``_pretrain_common``, and the optimizer/scheduler its helper makes
    (``max_lr`` is the helper's name for ``optimizer.lr``)."""
    base = next(
        f for f in common.body if isinstance(f, ast.FunctionDef) and f.name == "_pretrain_common"
    )
    helper_args: dict[str, ast.expr] = {}
    helper_name = ""
    for node in ast.walk(base):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "ConfigContainer":
                for kw in node.keywords:
                    if isinstance(kw.value, ast.Call) and kw.arg not in SKIPPED_SECTIONS:
                        yield from call_keywords(kw.value, kw.arg)
                    elif kw.arg == "mixed_precision":
                        yield "mixed_precision", *value_of(kw.value)
            elif node.func.id.endswith("_with_cosine_annealing"):
                helper_name = node.func.id
                helper_args = {kw.arg: kw.value for kw in node.keywords if kw.arg}
    helper = next(
        f for f in helpers.body if isinstance(f, ast.FunctionDef) and f.name == helper_name
    )
    defaults = dict(
        zip(
            [a.arg for a in helper.args.args][-len(helper.args.defaults) :],
            helper.args.defaults,
            strict=True,
        )
    )
    arguments = {**defaults, **helper_args}
    for node in ast.walk(helper):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            section = {"OptimizerConfig": "optimizer", "SchedulerConfig": "scheduler"}.get(
                node.func.id
            )
            if section:
                for kw in node.keywords:
                    value = kw.value
                    if isinstance(value, ast.Name) and value.id in arguments:
                        value = arguments[value.id]
                    if kw.arg:
                        yield f"{section}.{kw.arg}", *value_of(value)


def recipe_files(names: list[str]) -> list[str]:
    chosen = []
    for name in names:
        parts = name.split("/")
        if (
            len(parts) == 6
            and parts[:3] == ["megatron", "bridge", "recipes"]
            and parts[4] == "h100"
        ):
            family, file = parts[3], parts[5]
            if family in FAMILIES and (family != "qwen" or file in FAMILY_FILES):
                chosen.append(name)
    return sorted(chosen)


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        read = lambda name: ast.parse(z.read(name).decode())  # noqa: E731
        found = list(common_assignments(read(COMMON), read(OPTIMIZER_HELPERS)))
        files = recipe_files(z.namelist())
        for name in files:
            found += recipe_assignments(read(name))
    found = [f for f in found if f[0].split(".")[0] not in SKIPPED_SECTIONS]
    counts = Counter((key, json.dumps(value), literal) for key, value, literal in found)
    entries = [
        {"key": key, "value": json.loads(value), "literal": literal, "times": n}
        for (key, value, literal), n in sorted(counts.items())
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {"source": Path(wheel).name, "recipe_files": files, "assignments": entries}, indent=1
        )
        + "\n"
    )
    keys = {e["key"] for e in entries}
    print(
        f"{len(entries)} distinct (key, value) pairs, {len(keys)} keys, from {len(files)} files"
        f" -> {OUT}"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
