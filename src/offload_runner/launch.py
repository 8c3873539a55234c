"""Start training: torchrun through ``torch.distributed.run``'s Python API, or in place.

- Inside torchrun already (``in_torchrun``): train in this process.
- Otherwise: write the run directory, then start ``nproc_per_node`` workers (default: every
  visible GPU) running ``python -m offload_runner.worker --run-dir DIR``; each reads the resolved
  config from the run directory, so every rank trains exactly the same configuration.

A failing rank ends the job; the launcher names it and its log file and returns 1.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from offload_runner import console
from offload_runner.config.schema import LauncherConfig, RunConfig
from offload_runner.metrics import LAUNCHED_AT_ENV
from offload_runner.progress import in_torchrun
from offload_runner.rundir import create_run_dir, rank_log, write_status

WORKER_MODULE = "offload_runner.worker"


def nodes(launcher: LauncherConfig) -> int | None:
    """The node count when it is fixed (``"4"``, ``"4:4"``), None for an elastic range."""
    low, _, high = launcher.nnodes.partition(":")
    if high and high != low:
        return None
    return int(low)


def gpus_per_node(launcher: LauncherConfig, visible: int) -> int:
    return launcher.nproc_per_node or visible


def planned_world_size(launcher: LauncherConfig, visible: int) -> int | None:
    """Ranks the job will have: WORLD_SIZE inside torchrun, else nodes x GPUs per node (None
    while the node count is an elastic range)."""
    if in_torchrun():
        return int(os.environ["WORLD_SIZE"]) if os.environ["WORLD_SIZE"].isdigit() else None
    node_count = nodes(launcher)
    return None if node_count is None else node_count * gpus_per_node(launcher, visible)


SUBMITIT_PORT = 29500  # the rendezvous port on a submitit job's first node


def submitit_rendezvous(
    launcher: LauncherConfig, environ: Mapping[str, str] = os.environ
) -> dict[str, Any]:
    """Inside a job that Hydra's submitit launcher started (``hydra/launcher=submitit_slurm``,
    one task per node): the launcher keys that make this node's torchrun agent join the others,
    from submitit's job environment (Slurm's node list, node id, job id). Keys the user set
    (nnodes other than 1, an rdzv_endpoint) are kept; outside such a job nothing changes."""
    if not environ.get("SUBMITIT_EXECUTOR"):
        return {}
    import submitit

    job = submitit.JobEnvironment()
    found: dict[str, Any] = {}
    if launcher.nnodes == "1":
        found["launcher.nnodes"] = str(job.num_nodes)
    if launcher.rdzv_endpoint is None:
        found["launcher.rdzv_endpoint"] = f"{job.hostnames[0]}:{SUBMITIT_PORT}"
        found["launcher.rdzv_id"] = f"submitit-{job.job_id}"
        found["launcher.node_rank"] = job.node
    return found


def torchrun_args(launcher: LauncherConfig, nproc_per_node: int, run_dir: Path) -> list[str]:
    """torch.distributed.run's arguments for this launcher config."""
    args = ["--nproc-per-node", str(nproc_per_node), "--max-restarts", str(launcher.max_restarts)]
    if nodes(launcher) == 1:
        args.append("--standalone")
    else:
        args += [
            "--nnodes",
            launcher.nnodes,
            "--node-rank",
            str(launcher.node_rank),
            "--rdzv-backend",
            launcher.rdzv_backend,
            "--rdzv-endpoint",
            str(launcher.rdzv_endpoint),
            "--rdzv-id",
            launcher.rdzv_id,
        ]
    return [*args, "--module", WORKER_MODULE, "--run-dir", str(run_dir)]


def worker_environment() -> None:
    """The environment the ranks need before they import torch's CUDA or Transformer Engine; the
    user's own settings win."""
    # torch's cache grows segments in place instead of keeping freed blocks of fixed sizes: at
    # the edge of a GPU's memory its slack is what runs out (3.4 GiB cached, unallocated, when
    # the full model ran out on two H200)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # TE's multi-tensor kernels (the gradient-norm clip) take a handle per tensor: the whole
    # Qwen3-30B-A3B on one rank holds more than TE's default pool's 20,321 (20 MiB)
    os.environ.setdefault("NVTE_TENSOR_HANDLE_POOL_SIZE_MB", "64")


def launch(
    run: RunConfig,
    resolved: Mapping[str, Any],
    overrides: Sequence[str],
    run_dir: str | Path,
    unique: bool = False,
) -> int:
    """Train ``run`` into ``run_dir`` (``unique``: a new folder, see create_run_dir); returns the
    process exit code. The run directory gets a status.json either way (``ok``, ``oom`` or
    ``failed``, with the rank that failed)."""
    worker_environment()
    if in_torchrun():
        from offload_runner.worker import train_in_place

        return train_in_place(run, resolved, overrides, run_dir, unique)

    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    nproc = gpus_per_node(run.launcher, torch.cuda.device_count())
    run_dir = create_run_dir(run_dir, resolved, overrides, unique=unique)
    console.console.print(
        f"launching {nproc} process(es) per node x {run.launcher.nnodes} node(s); "
        f"run directory [bold]{run_dir}[/]"
    )
    os.environ[LAUNCHED_AT_ENV] = str(time.time())  # workers count time to first step from here
    try:
        torchrun(parse_args(torchrun_args(run.launcher, nproc, run_dir)))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        oom = ran_out_of_memory(rank_log(run_dir, rank))
        write_status(run_dir, "oom" if oom else "failed", rank=rank, exitcode=failure.exitcode)
        what_fits = "; --plan shows what fits, offload/optimizer=auto picks the least offload"
        against = oom_against_plan(run, rank_log(run_dir, rank), nproc) if oom else ""
        console.fail(
            f"rank {rank} {'ran out of GPU memory' if oom else 'failed'} (exit code "
            f"{failure.exitcode}){against}; the job was stopped",
            f"see {rank_log(run_dir, rank)}" + (f"{what_fits} that does" if oom else ""),
        )
        return 1
    write_status(run_dir, "ok")
    return 0


OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")


# torch's out-of-memory message: what was asked, and what PyTorch had allocated then
OOM_ASKED = re.compile(r"Tried to allocate ([0-9.]+) (GiB|MiB)")
OOM_HELD = re.compile(r"Of the allocated memory ([0-9.]+) (GiB|MiB) is allocated by PyTorch")


def oom_against_plan(run: RunConfig, log: Path, nproc: int) -> str:
    """', planned peak P GB: it held H GB and asked A GB more' from the rank's log and the
    plan (plan.py), or '' where the log does not say."""
    from offload_runner.plan import planned_peaks

    text = log.read_text(errors="replace") if log.is_file() else ""
    asked, held = OOM_ASKED.findall(text), OOM_HELD.findall(text)
    if not (asked and held):
        return ""
    gb = [float(v) / (1 if unit == "GiB" else 1024) for v, unit in (held[-1], asked[-1])]
    planned = planned_peaks(run, planned_world_size(run.launcher, nproc))
    return (
        f": planned peak {planned['planned_gpu_peak_gb']:.1f} GB, it held {gb[0]:.1f} GB and "
        f"asked {gb[1]:.2f} GB more"
    )


def ran_out_of_memory(log: Path) -> bool:
    """Whether a rank's log shows a GPU out-of-memory error."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return any(marker in text for marker in OOM_MARKERS)
