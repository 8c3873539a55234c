"""What every rank runs: ``python -m offload_runner.worker --run-dir DIR`` (started by torchrun).

Rank 0 prints to the console and logs to rank0.log; every other rank's stdout and stderr go to
its own rank<N>.log, so a crash anywhere leaves its trace in the run directory.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing.errors import record

from offload_runner.rundir import VERBOSE_ENV, RunDirError, create_run_dir, load_resolved, rank_log

if TYPE_CHECKING:
    from offload_runner.config.schema import RunConfig


def setup_rank_logging(run_dir: Path, rank: int) -> None:
    """The rank's log: our own lines, and every library's warnings (Megatron-Core's and
    Transformer Engine's loggers, Python warnings), which reach the terminal only with
    ``--verbose``; ranks other than 0 send all their output there. Set up before anything
    imports Megatron-Core: it warns at import."""
    path = rank_log(run_dir, rank)
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    if rank != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(stream.fileno(), 1)
        os.dup2(stream.fileno(), 2)
    faulthandler.enable(file=stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    logger = logging.getLogger("offload_runner")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logging.captureWarnings(True)
    root = logging.getLogger()
    root.handlers = [handler]
    if rank == 0 and os.environ.get(VERBOSE_ENV) == "1":
        root.addHandler(logging.StreamHandler(sys.stderr))
    root.setLevel(logging.WARNING)


def _train(run: RunConfig, run_dir: Path, rank: int) -> int:
    from offload_runner.offload import apply_runtime_environment
    from offload_runner.train import train

    env = apply_runtime_environment(run)
    if env:
        logging.getLogger("offload_runner").info("environment for this config: %s", env)
    try:
        train(run, run_dir)
    except Exception:
        # the traceback goes to the rank's log only; the launcher's one line names the log (and,
        # out of GPU memory, the fix), so the terminal shows no torch traceback before it
        logging.getLogger("offload_runner").exception("rank %d failed", rank)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


@record
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one offload-runner training rank")
    parser.add_argument("--run-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    setup_rank_logging(args.run_dir, rank)
    return _train(load_resolved(args.run_dir), args.run_dir, rank)


def train_in_place(
    run: RunConfig,
    resolved: Mapping[str, Any],
    overrides: Sequence[str],
    run_dir: str | Path,
    unique: bool = False,
) -> int:
    """The user started torchrun around run_recipe.py: rank 0 makes the run directory and every
    rank takes its path from rank 0 (or rank 0's RunDirError, so that no rank waits on it)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    made: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            made = [str(create_run_dir(run_dir, resolved, overrides, unique))]
        except RunDirError as err:
            made = [(str(err), err.fix)]
    dist.broadcast_object_list(made, src=0)
    if isinstance(made[0], tuple):
        raise RunDirError(*made[0])
    setup_rank_logging(Path(made[0]), dist.get_rank())
    return _train(run, Path(made[0]), dist.get_rank())


if __name__ == "__main__":
    sys.exit(main())
