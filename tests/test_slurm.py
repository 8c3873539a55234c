"""Slurm through Hydra's submitit launcher plugin: each job (one per sweep point) runs one
torchrun agent per node, and the agents meet at the first node of the job's node list."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from offload_runner.config.schema import LauncherConfig
from offload_runner.launch import submitit_rendezvous, torchrun_args

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

SLURM_NODE_2_OF_4 = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[001-004]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
}


def test_a_slurm_node_joins_the_rendezvous_at_the_first_node(monkeypatch) -> None:
    for key, value in SLURM_NODE_2_OF_4.items():
        monkeypatch.setenv(key, value)
    found = submitit_rendezvous(LauncherConfig())
    assert found == {
        "launcher.nnodes": "4",
        "launcher.rdzv_endpoint": "gpu001:29500",
        "launcher.rdzv_id": "submitit-77",
        "launcher.node_rank": 2,
    }
    launcher = LauncherConfig(
        nnodes="4", node_rank=2, rdzv_endpoint="gpu001:29500", rdzv_id="submitit-77"
    )
    args = " ".join(torchrun_args(launcher, 8, Path("/runs/x")))
    assert "--nnodes 4 --node-rank 2 --rdzv-backend c10d --rdzv-endpoint gpu001:29500" in args
    assert "--nproc-per-node 8" in args and "--standalone" not in args


def test_what_the_user_set_is_kept_and_nothing_changes_outside_a_job(monkeypatch) -> None:
    for key, value in SLURM_NODE_2_OF_4.items():
        monkeypatch.setenv(key, value)
    mine = LauncherConfig(nnodes="2", rdzv_endpoint="head:29400")
    assert submitit_rendezvous(mine) == {}
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    assert submitit_rendezvous(LauncherConfig()) == {}


def test_sweep_through_the_plugins_local_executor(tmp_path: Path) -> None:
    """The plugin's local executor runs each sweep point as its own submitted job."""
    from tests.conftest import run_cli

    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "--recipe",
        "tiny",
        "--dry-run",
        "hydra/launcher=submitit_local",
        "train.seed=1,2",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    seeds = []
    for job in ("0", "1"):
        config = yaml.safe_load((sweep / job / "config.yaml").read_text())
        assert config["launcher"]["rdzv_id"].startswith("submitit-")  # made inside a submitit job
        seeds.append(config["train"]["seed"])
    assert seeds == [1, 2]
    assert list((sweep / ".submitit").iterdir())  # the executor's own job folders


def test_more_than_one_task_per_node_is_refused(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "--recipe",
        "tiny",
        "--dry-run",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 2  # the job's own exit code, read back from its saved result
    logs = " ".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.err"))
    assert "hydra.launcher.tasks_per_node must be 1" in " ".join(logs.split())
    assert not (sweep / "0" / "config.yaml").exists()


def _sweep_away_from_slurm(sweep: Path, *extra: str):
    """README's Slurm line (with ``extra``) run as a user would, where there is no srun."""
    import shutil

    from tests.conftest import run_cli

    if shutil.which("srun"):
        pytest.skip("Slurm is here: the sweep is submitted")
    args = ("hydra/launcher=submitit_slurm", "hydra.launcher.nodes=4", f"hydra.sweep.dir={sweep}")
    return run_cli("-m", "--recipe", "tiny", *extra, *args)


def test_a_slurm_sweep_dry_runs_away_from_slurm(tmp_path: Path) -> None:
    """README's Slurm line with --dry-run on a machine without srun: the jobs are checked here
    (submitit's executor would raise 'Could not detect srun')."""
    sweep = tmp_path / "sweep"
    result = _sweep_away_from_slurm(sweep, "--dry-run", "hydra.launcher.partition=gpu")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "no Slurm here" in result.stdout and (sweep / "0" / "config.yaml").is_file()


def test_a_slurm_sweep_to_submit_away_from_slurm_is_one_line(tmp_path: Path) -> None:
    """README's Slurm line where there is no srun: one line and a fix, exit 2, no sweep folder
    (submitit said it in a traceback, and Hydra left multirun.yaml)."""
    sweep = tmp_path / "sweep"
    result = _sweep_away_from_slurm(sweep)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "there is no srun here" in result.stderr and not sweep.exists()
