"""The package's shape: its import graph has no circle (every import an offload_runner module
makes of another, at the top or inside a function, points one way, so the planner never reaches
the engines it prices, and a module can be read before the ones that use it), and no function
is longer than a screen."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "offload_runner").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the offload_runner modules it imports (``from pkg import sub`` names ``sub``
    where it is a module, else ``pkg``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_offload_runner_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_planner_never_imports_an_engine() -> None:
    graph = import_graph()
    for planner in (
        "offload_runner.plan",
        "offload_runner.step_cost",
        "offload_runner.auto",
        "offload_runner.hardware",
    ):
        assert not {m for m in graph[planner] if m.startswith("offload_runner.offload")}


def test_the_circle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_under_src_is_longer_than_80_lines() -> None:
    """A function a reader can hold: split by concern where one grows past a screen."""
    long = []
    for path in (SRC / "offload_runner").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines})")
    assert long == []


def test_library_import_warnings_stay_out_of_the_terminal(tmp_path: Path) -> None:
    """Megatron-Core's compile-time warning (a SyntaxWarning from Python 3.12) and TE's JAX
    RuntimeWarning, as the GPU machine printed them, are silent once offload_runner is imported
    (and print without it)."""
    import subprocess
    import sys

    package = tmp_path / "megatron" / "core"
    package.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (package / "__init__.py").write_text('"""Evict \\- blocks."""\n')
    raise_te = (
        "import warnings; warnings.warn('Detected a Jax installation but could not find', "
        "RuntimeWarning)"
    )

    def stderr(first: str) -> str:
        code = f"{first}import megatron.core; {raise_te}"
        env = {"PYTHONPATH": f"{tmp_path}:{SRC}", "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run(
            [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, env=env
        )
        return done.stderr

    assert "invalid escape sequence" in stderr("") and "Jax" in stderr("")
    assert stderr("import offload_runner; ") == ""


def test_every_host_engine_answers_what_engines_asks() -> None:
    """engines.HostEngine is the interface the training loop's ``Engines`` calls: each engine
    kind has every member it names (a renamed or dropped method fails here, not mid-run)."""
    import inspect

    from offload_runner.offload.cpu_adam.engine import CpuAdam
    from offload_runner.offload.engines import HostEngine
    from offload_runner.offload.optimizer_states import WindowedStates
    from offload_runner.offload.weight import WeightOffload

    asked = {n for n, _ in inspect.getmembers(HostEngine) if not n.startswith("_")}
    assert asked == {"pinned_bytes", "finish", "flush", "close"}
    for engine in (CpuAdam, WindowedStates, WeightOffload):
        assert all(callable(getattr(engine, n, None)) or n == "pinned_bytes" for n in asked)
        assert isinstance(inspect.getattr_static(engine, "pinned_bytes"), property)


def test_host_engines_take_settings_and_their_parts_read_no_private_attribute() -> None:
    """CpuAdam, WindowedStates and HostAdam are built from settings objects (at most 6
    parameters besides self); the CPU-Adam engine's parts (Link, Share, Delay, ...) read the
    engine's public surface, never one of its _private attributes, and Link, Share and Delay
    are handed the shard (host arrays, pieces, history), never the engine."""
    import inspect
    import re

    from offload_runner.offload.cpu_adam.engine import CpuAdam
    from offload_runner.offload.host_adam import HostAdam
    from offload_runner.offload.optimizer_states import WindowedStates

    for engine in (CpuAdam, WindowedStates, HostAdam):
        assert len(inspect.signature(engine.__init__).parameters) - 1 <= 6, engine
    parts = sorted((SRC / "offload_runner" / "offload" / "cpu_adam").glob("*.py"))
    assert len(parts) >= 8
    private = re.compile(r"\b(?:e|eng|engine|self\.engine)\._[a-z]")
    for path in parts:
        assert not private.search(path.read_text()), path.name
    from offload_runner.offload.cpu_adam import delayed, gpu_share, landing

    for part in (landing.Link, gpu_share.Share, delayed.Delay):
        names = list(inspect.signature(part.__init__).parameters)
        assert names[1] == "shard" and "engine" not in names, part
        assert "self.engine" not in inspect.getsource(part), part
