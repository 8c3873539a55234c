"""Reports from Markdown templates: the words live in bench/templates/, each ``{{part}}`` or
``{{part:argument}}`` in them is filled by a function of the report's module from the results
and evidence files (so no figure in a report is typed by hand)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
PLACEHOLDER = re.compile(r"\{\{(\w+)(?::([^}]*))?\}\}")


def fill(template: str, parts: dict[str, Callable[..., str]]) -> str:
    """bench/templates/``template`` with every placeholder replaced by its part's text (a
    part with an argument is called with it). An unknown part is an error, not a blank."""
    text = (TEMPLATES / template).read_text()

    def one(match: re.Match) -> str:
        name, argument = match.groups()
        if name not in parts:
            raise KeyError(f"{template}: no part {name!r} (parts: {', '.join(sorted(parts))})")
        return parts[name]() if argument is None else parts[name](argument)

    return PLACEHOLDER.sub(one, text)
