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


def create_run_dir(path: str | Path, resolved: Mapping[str, Any], overrides: Sequence[str]) -> Path:
    """Make the folder and write the resolved config and the overrides that produced it."""
    run_dir = Path(path)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(dict(resolved))))
    (run_dir / OVERRIDES_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    return run_dir


def rank_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.log"


def metrics_file(run_dir: Path) -> Path:
    return Path(run_dir) / "metrics.jsonl"


def write_status(run_dir: Path, status: str, **details: Any) -> None:
    """How the run ended: ``ok``, ``oom`` or ``failed`` (sweep tables read it)."""
    (Path(run_dir) / STATUS_FILE).write_text(json.dumps({"status": status, **details}))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_resolved(run_dir: Path):  # -> RunConfig
    """The typed config a launcher wrote into the run directory."""
    from offload_runner.config.schema import RunConfig

    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(run_dir / CONFIG_FILE))
    return OmegaConf.to_object(merged)
