"""What a check of the configuration reports: a violation, its level, its fix. The rules
(validation.py) make them; the console and the CLI print them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Level(str, Enum):
    error = "error"
    warning = "warning"


@dataclass(frozen=True)
class Violation:
    rule: str
    level: Level
    message: str
    fix: str
    environment: bool = False  # about this machine (e.g. Transformer Engine missing), not the input

    def __str__(self) -> str:
        return f"{self.message}\n    fix: {self.fix}"
