"""The run directory: one per job, shared by all ranks.

Layout: ``config.yaml`` (resolved), ``overrides.yaml``, ``rank<N>.log``, ``metrics.jsonl``,
``summary.json`` and reports. It is created only after validation has passed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

CONFIG_FILE = "config.yaml"
OVERRIDES_FILE = "overrides.yaml"
STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.json"


def writable(folder: Path) -> bool:
    """Whether this process can make files in ``folder``, or where it is not there yet, in the
    nearest folder above it that is: a file made and gone at once (the permission bits do not
    say it under /proc, or for root)."""
    import tempfile

    existing = next(p for p in (folder, *folder.parents) if p.exists())
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError:  # not a folder, not ours to write, not a file system that takes files
        return False
    return True


class RunDirError(Exception):
    """The run directory cannot be made or written (permissions, a name too long, a file in the
    way): a one-line message and its fix, for the command line to print."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def create_run_dir(
    path: str | Path, resolved: Mapping[str, Any], overrides: Sequence[str], unique: bool = False
) -> Path:
    """Make the folder and write the resolved config and the overrides that produced it.

    ``unique``: the folder must be new (a time-stamped default name): if another run took it in
    the same second, this one gets ``<name>-2``, ``-3``, ... (mkdir is atomic between processes).
    """
    run_dir = Path(path)
    if not str(path).strip() or run_dir.resolve() == Path.cwd().resolve():
        raise RunDirError(
            f"output_dir={str(path)!r} names this folder: its config.yaml and overrides.yaml "
            "would be written over yours",
            "set output_dir= to a folder of the run's own (e.g. output_dir=runs/first), or "
            "leave it out for outputs/<date>/<time>-<recipe>/",
        )
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir = _claim(run_dir) if unique else run_dir
        run_dir.mkdir(exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(dict(resolved))))
        (run_dir / OVERRIDES_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise RunDirError(
            f"cannot write the run directory {path}: {reason}",
            "set output_dir= to a folder you may write, with a shorter name if it is too long",
        ) from None
    return run_dir


def _claim(run_dir: Path) -> Path:
    for n in range(1, 1000):
        candidate = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(run_dir)


# run_recipe.py --verbose: the ranks show Megatron-Core's, TE's and torch's warnings too (else in
# their logs only)
VERBOSE_ENV = "OFFLOAD_RUNNER_VERBOSE"


def rank_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.log"


def metrics_file(run_dir: Path) -> Path:
    return Path(run_dir) / "metrics.jsonl"


def write_status(run_dir: Path, status: str, **details: Any) -> None:
    """How the run ended: ``ok``, ``oom`` or ``failed`` (sweep tables read it)."""
    (Path(run_dir) / STATUS_FILE).write_text(json.dumps({"status": status, **details}))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def resolved_config(run_dir: Path) -> dict:
    """The resolved config a launcher wrote into the run directory, as plain data ({} if none)."""
    path = Path(run_dir) / CONFIG_FILE
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}  # type: ignore[return-value]


def load_resolved(run_dir: Path):  # -> RunConfig
    """The typed config a launcher wrote into the run directory."""
    from offload_runner.config.megatron_fields import run_schema

    merged = OmegaConf.merge(
        OmegaConf.structured(run_schema()), OmegaConf.load(run_dir / CONFIG_FILE)
    )
    return OmegaConf.to_object(merged)
