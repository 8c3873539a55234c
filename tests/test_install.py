"""The installed wheel works outside the checkout: it carries conf/ and recipes/ (issue: "Primary
config directory not found" after ``pip install .``), and --version names this project."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT

# Run the CLI from the installed wheel only: the checkout's editable install is taken off the
# import machinery first, so nothing can come from src/, conf/ or recipes/.
BOOTSTRAP = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path.insert(0, sys.argv.pop(1))
import offload_runner.cli as cli
assert cli.__file__.startswith(sys.path[0]), cli.__file__
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(out),
            str(PROJECT_ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("offload_runner-*.whl")
    site = out / "site"  # a fresh install target: pip installs the wheel there, nothing else
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return site


def cli(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BOOTSTRAP, str(site), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_wheel_carries_the_configs_and_recipes(wheel_site: Path) -> None:
    packaged = wheel_site / "offload_runner"
    assert (packaged / "_conf/config.yaml").is_file()
    assert (packaged / "_conf/offload/optimizer/cpu_adam.yaml").is_file()
    assert {p.stem for p in (packaged / "_recipes").glob("*.yaml")} == {
        p.stem for p in (PROJECT_ROOT / "recipes").glob("*.yaml")
    }


def test_wheel_carries_every_module(wheel_site: Path) -> None:
    """Every module of the source tree, subpackages too (setuptools lists packages by name)."""
    source = PROJECT_ROOT / "src"
    modules = {p.relative_to(source) for p in (source / "offload_runner").rglob("*.py")}
    assert {m for m in modules if not (wheel_site / m).is_file()} == set()


def test_installed_cli_runs_outside_the_checkout(wheel_site: Path, tmp_path: Path) -> None:
    listed = cli(wheel_site, "--list-recipes", cwd=tmp_path)
    assert listed.returncode == 0 and "qwen3_30b_a3b_proxy" in listed.stdout, listed.stderr
    dry = cli(
        wheel_site, "--recipe", "tiny", "--dry-run", f"output_dir={tmp_path / 'run'}", cwd=tmp_path
    )
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert (tmp_path / "run/config.yaml").is_file()
    helped = cli(wheel_site, "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "offload/optimizer" in helped.stdout, helped.stderr[-2000:]


def test_version_names_this_project(wheel_site: Path, tmp_path: Path) -> None:
    shown = cli(wheel_site, "--version", cwd=tmp_path)
    assert shown.returncode == 0
    assert shown.stdout.startswith("offload-runner ") and "megatron-core" in shown.stdout


def test_transformer_engine_floor_is_past_its_offload_bugs() -> None:
    """TE 2.5-2.9 raise "...not mentioned what to offload" at model build with
    cpu_offloading_activations=false even with offloading off, and TE 2.9 looks up layer 0 in an
    empty map with cpu_offloading_num_layers=0; the rules are written for TE >= 2.10 (the GPU
    machine runs 2.20.2), so the `te` extra may not install an older one."""
    import re

    import tomllib

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    te = tomllib.loads(text)["project"]["optional-dependencies"]["te"]
    floor = re.search(r">=\s*(\d+)\.(\d+)", te[0])
    assert floor and (int(floor.group(1)), int(floor.group(2))) >= (2, 10), te
