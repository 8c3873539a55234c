"""Every dry-run and plan command printed in README.md and in --help runs as printed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT

from offload_runner.cli import EXIT_FAILED, EXIT_OK, main


def _readme_commands() -> list[str]:
    text = (PROJECT_ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.split("#")[0].strip() for line in lines if line.startswith("python run_recipe.py")]


def _help_commands() -> list[str]:
    text = (PROJECT_ROOT / "conf/config.yaml").read_text()
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip().startswith("python run_recipe.py")
    ]


COMMANDS = sorted(
    {
        c
        for c in _readme_commands() + _help_commands()
        if ("--dry-run" in c or "--plan" in c) and "<" not in c
    }
)


def test_the_documents_hold_runnable_examples() -> None:
    assert len(COMMANDS) >= 5


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_command_runs(command: str, tmp_path: Path) -> None:
    args = shlex.split(command)[2:]  # without "python run_recipe.py"
    code = main([*args, f"output_dir={tmp_path}/run"])
    # --plan exits 1 where the plan does not fit (the README shows one such case)
    assert code == EXIT_OK or ("--plan" in args and code == EXIT_FAILED), command
