"""The installed Megatron-Core's own config fields, as ``model.*``, ``optimizer.*``, ``ddp.*`` keys.

``model.*`` takes every field of Megatron-Core's TransformerConfig, ``optimizer.*`` every field of
its OptimizerConfig and ``ddp.*`` every field of its DistributedDataParallelConfig, read from the
megatron-core installed here (0.16 and 0.19 differ by dozens of fields). The project's own fields
(schema.py) come first and win where both name a key; a key neither knows is still refused, with
the closest one.

A field becomes a key when a command line can write its type: bool, int, float, str, an enum, a
``Literal`` (its choices are checked, ``literal_choices``), a list of those, a union of them
(typed ``Any``), or ``torch.dtype`` (``bf16``/``fp32``/``fp16``, as Megatron-Bridge writes it).
Callables and objects (``activation_func``, ``init_method``, ``timers``) are set by the code, never
on a command line. A key keeps Megatron-Core's default, or null where that default is an object;
null always means "Megatron-Core's default", and its value reaches Megatron-Core unchanged
(``mcore/megatron_config.py``), whose own checks then run in validation.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from functools import cache
from typing import Any, List, Literal, Optional, Union  # noqa: UP035 - OmegaConf reads these

from offload_runner.config.schema import (
    DDPConfig,
    ModelConfig,
    OptimizerConfig,
    OptimizerDtype,
    RunConfig,
)

PRIMITIVES = (bool, int, float, str)
UNWRITABLE = object()  # a type or default no command line can write


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of ours and the Megatron-Core config class behind it."""

    key: str
    ours: type
    module: str
    name: str

    def megatron_class(self) -> type:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)


SECTIONS = (
    Section(
        "model", ModelConfig, "megatron.core.transformer.transformer_config", "TransformerConfig"
    ),
    Section(
        "optimizer", OptimizerConfig, "megatron.core.optimizer.optimizer_config", "OptimizerConfig"
    ),
    Section(
        "ddp",
        DDPConfig,
        "megatron.core.distributed.distributed_data_parallel_config",
        "DistributedDataParallelConfig",
    ),
)


def cli_type(annotation: Any) -> Any:
    """The structured-config type of a Megatron-Core annotation, or UNWRITABLE."""
    import torch

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in PRIMITIVES or annotation is Any:
        return annotation
    if annotation is torch.dtype:
        return OptimizerDtype
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return annotation
    if origin is Literal:
        return str if all(isinstance(a, str) for a in args) else Any
    if origin in (list, List):  # noqa: UP006
        item = cli_type(args[0]) if args else Any
        return List[item] if item in PRIMITIVES else List[Any]  # noqa: UP006
    if origin is tuple:
        return List[Any]  # noqa: UP006
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        types = [cli_type(a) for a in inner]
        if len(inner) == 1:
            return UNWRITABLE if types[0] is UNWRITABLE else Optional[types[0]]  # noqa: UP045
        return Any if any(t is not UNWRITABLE for t in types) else UNWRITABLE
    return UNWRITABLE


def field_default(field: dataclasses.Field) -> Any:
    """A dataclass field's default (its factory's product), or MISSING."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def cli_default(field: dataclasses.Field) -> Any:
    """Megatron-Core's default where a config file can hold it, else None."""
    value = field_default(field)
    if value is dataclasses.MISSING or value is None or isinstance(value, (*PRIMITIVES, Enum)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, PRIMITIVES) for v in value):
        return list(value)
    return None  # an object (torch.dtype, a callable): null leaves Megatron-Core's default


def _fields_of(section: Section) -> list[tuple[str, Any, dataclasses.Field]]:
    """(name, type, field) for each Megatron-Core field the project does not define itself."""
    theirs = section.megatron_class()
    hints = _type_hints(theirs)
    ours = {f.name for f in dataclasses.fields(section.ours)}
    added = []
    for f in dataclasses.fields(theirs):
        if not f.init or f.name.startswith("_") or f.name in ours:
            continue
        kind = cli_type(hints.get(f.name, Any))
        if kind is UNWRITABLE:
            continue
        default = cli_default(f)
        if typing.get_origin(kind) is not Union and kind is not Any:
            kind = Optional[kind]  # noqa: UP045 - null: Megatron-Core's default
        if isinstance(default, list):
            spec = dataclasses.field(default_factory=lambda d=default: list(d))
        else:
            spec = dataclasses.field(default=default)
        added.append((f.name, kind, spec))
    return added


def _type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations; a name that does not resolve leaves that field's type as written."""
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):
        return {f.name: f.type for f in dataclasses.fields(cls)}


def megatron_field_names() -> dict[str, frozenset[str]]:
    """Section -> the keys it takes from the installed Megatron-Core (empty without it)."""
    schema = {f.name: f.default_factory for f in dataclasses.fields(run_schema())}
    return {
        s.key: frozenset(f.name for f in dataclasses.fields(schema[s.key]))
        - {f.name for f in dataclasses.fields(s.ours)}
        for s in SECTIONS
    }


@cache
def literal_choices() -> dict[str, tuple[str, ...]]:
    """``section.key`` -> the choices of a Megatron-Core ``Literal`` field we take as a str."""
    choices: dict[str, tuple[str, ...]] = {}
    for s in SECTIONS:
        try:
            hints = _type_hints(s.megatron_class())
        except ImportError:
            continue
        for name in megatron_field_names()[s.key]:
            annotation = hints[name]
            if typing.get_origin(annotation) is Union:
                inner = [a for a in typing.get_args(annotation) if a is not type(None)]
                annotation = inner[0] if len(inner) == 1 else annotation
            if typing.get_origin(annotation) is Literal:
                choices[f"{s.key}.{name}"] = typing.get_args(annotation)
    return choices


@cache
def run_schema() -> type:
    """RunConfig whose model/optimizer/ddp sections also take Megatron-Core's own fields."""
    try:
        extended = {s.key: _extend(s) for s in SECTIONS}
    except ImportError:  # no megatron-core: the project's own fields only
        return RunConfig
    fields = [(key, cls, dataclasses.field(default_factory=cls)) for key, cls in extended.items()]
    return _subclass(RunConfig, fields)


def _extend(section: Section) -> type:
    return _subclass(section.ours, _fields_of(section))


def _subclass(base: type, fields: list) -> type:
    cls = dataclasses.make_dataclass(base.__name__, fields, bases=(base,))
    cls.__doc__ = base.__doc__
    return cls
