"""Reports from Markdown templates: the words live in bench/templates/, each ``{{part}}`` or
``{{part:argument}}`` in them is filled by a function of the report's module from the results
and evidence files (so no figure in a report is typed by hand)."""

from __future__ import annotations

import contextlib
import functools
import io
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "docs" / "evidence"
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


def printed(part: Callable[[], None]) -> Callable[[], str]:
    """A part written with print(), run from the project root: its output as the part's text."""

    @functools.wraps(part)
    def text() -> str:
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.chdir(ROOT):
            part()
        return out.getvalue().rstrip("\n")

    return text


# Parts that quote docs/evidence files, ``FILE|ARGUMENT`` after the part's name.
def first(argument: str) -> str:
    """``FILE|REGEX``: REGEX's first match in the evidence file."""
    name, pattern = argument.split("|", 1)
    found = re.search(pattern, (EVIDENCE / name).read_text(), re.M)
    return found.group(0) if found else f"(no {pattern!r} in {name})"


def matching(argument: str) -> str:
    """``FILE|REGEX``: the evidence file's lines that match, each a list item."""
    name, pattern = argument.split("|", 1)
    lines = (EVIDENCE / name).read_text().splitlines()
    return "\n".join(f"- {ln}" for ln in lines if re.match(pattern, ln))


def count(argument: str) -> str:
    """``FILE|TEXT``: how many times TEXT stands in the evidence file."""
    name, text = argument.split("|", 1)
    return str((EVIDENCE / name).read_text().count(text))


def tail(argument: str) -> str:
    """``FILE|N``: the evidence file from its N-th line on."""
    name, start = argument.split("|")
    return "\n".join((EVIDENCE / name).read_text().splitlines()[int(start) - 1 :])


EVIDENCE_PARTS = {"first": first, "matching": matching, "count": count, "tail": tail}
