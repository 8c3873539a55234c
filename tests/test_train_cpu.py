"""CPU-testable pieces of the trainer and launcher."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from offload_runner.config.schema import LauncherConfig
from offload_runner.launch import in_torchrun, nodes, torchrun_args
from offload_runner.mcore.data import MicroBatchSampler, parse_blend
from offload_runner.metrics import LAUNCHED_AT_ENV, Startup
from offload_runner.train import context_parallel_slice, loss_func


def test_reported_loss_survives_the_schedules_in_place_scaling() -> None:
    output = torch.tensor([[2.0, 4.0], [6.0, 8.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, report = loss_func(mask, output)
    assert loss.item() == 4.0
    loss /= 4  # what Megatron-Core's forward_step does with num_microbatches
    assert report["lm loss"].item() == 4.0


def _context_parallel_rank(rank: int, world: int, tmp: Path) -> None:
    """One CP rank: its slice of a micro-batch, its loss, the gradient DDP would average."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    per_token = torch.rand(2, 16)  # the whole micro-batch's token losses, as the model computes
    mask = (torch.rand(2, 16) > 0.3).float()
    positions = torch.arange(16).expand(2, 16)
    leaf = per_token.clone().requires_grad_()
    part = context_parallel_slice(
        {"losses": leaf, "loss_mask": mask, "position_ids": positions}, dist.group.WORLD
    )
    loss, report = loss_func(part["loss_mask"], part["losses"], cp_group=dist.group.WORLD)
    (loss * world).backward()  # what the schedule does with the CP size
    grad = leaf.grad.clone()
    dist.all_reduce(grad)
    grad /= world  # DDP's mean over the DP x CP ranks
    value = report["lm loss"].clone()
    dist.all_reduce(value)
    torch.save(
        {"grad": grad, "loss": value, "positions": part["position_ids"][0]}, tmp / f"rank{rank}.pt"
    )
    dist.destroy_process_group()


def test_context_parallel_loss_and_gradient_equal_the_whole_sequence(tmp_path: Path) -> None:
    """Two gloo ranks hold chunks (0, 3) and (1, 2) of each sequence; their summed loss shares
    and averaged gradients equal the single-rank loss and gradient of the whole sequence."""
    mp.spawn(_context_parallel_rank, args=(2, tmp_path), nprocs=2)
    torch.manual_seed(0)
    per_token = torch.rand(2, 16).requires_grad_()
    mask = (torch.rand(2, 16) > 0.3).float()
    loss, _ = loss_func(mask, per_token)
    loss.backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["positions"].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert ranks[1]["positions"].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for r in ranks:
        torch.testing.assert_close(r["loss"], loss.detach())
        torch.testing.assert_close(r["grad"], per_token.grad)


def test_micro_batches_cover_each_global_batch_once() -> None:
    dp, mbs, gbs = 2, 2, 8
    seen = {r: list(MicroBatchSampler(16, 0, mbs, r, dp)) for r in range(dp)}
    flat = sorted(i for batches in seen.values() for b in batches for i in b)
    assert flat == list(range(16))
    assert seen[0][0] == [0, 1] and seen[1][0] == [2, 3]
    resumed = list(MicroBatchSampler(16, gbs, mbs, 0, dp))
    assert resumed[0] == [8, 9]


def test_blend_parsing() -> None:
    assert parse_blend(["/d/a"]) == (["/d/a"], None)
    assert parse_blend(["0.7", "/d/a", "0.3", "/d/b"]) == (["/d/a", "/d/b"], [0.7, 0.3])


def test_torchrun_arguments_single_node(tmp_path: Path) -> None:
    args = torchrun_args(LauncherConfig(), 4, tmp_path)
    assert args[:2] == ["--nproc-per-node", "4"] and "--standalone" in args
    assert args[-4:] == ["--module", "offload_runner.worker", "--run-dir", str(tmp_path)]


def test_torchrun_arguments_multi_node(tmp_path: Path) -> None:
    launcher = LauncherConfig(nnodes="4", node_rank=2, rdzv_endpoint="node0:29400")
    args = torchrun_args(launcher, 8, tmp_path)
    assert "--standalone" not in args
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--nnodes"] == "4" and pairs["--node-rank"] == "2"
    assert pairs["--rdzv-endpoint"] == "node0:29400" and pairs["--rdzv-backend"] == "c10d"
    assert nodes(LauncherConfig(nnodes="2:4")) is None and nodes(launcher) == 4


def test_worker_environment_sizes_te_and_torch_but_the_users_settings_win(monkeypatch) -> None:
    """The whole Qwen3-30B-A3B on one rank needs more TE tensor handles than TE's default pool
    (its gradient clip failed at the first step on an H200, results-whole-model.json)."""
    from offload_runner.launch import worker_environment

    monkeypatch.delenv("NVTE_TENSOR_HANDLE_POOL_SIZE_MB", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    worker_environment()
    assert int(os.environ["NVTE_TENSOR_HANDLE_POOL_SIZE_MB"]) > 20
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_rank_detection() -> None:
    assert in_torchrun({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert in_torchrun({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})
    assert not in_torchrun({"RANK": "0", "WORLD_SIZE": "2"})  # left in a shell
    assert not in_torchrun({"RANK": "0"}) and not in_torchrun({})


def test_planned_world_size(monkeypatch) -> None:
    from offload_runner.launch import planned_world_size

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert planned_world_size(LauncherConfig(nnodes="2"), visible=8) == 16
    assert planned_world_size(LauncherConfig(nproc_per_node=4), visible=8) == 4
    assert planned_world_size(LauncherConfig(nnodes="1:4"), visible=8) is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert planned_world_size(LauncherConfig(), visible=8) == 32


def test_manual_gc_collects_only_on_its_interval(monkeypatch) -> None:
    import gc

    from offload_runner.train import ManualGC

    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    assert gc.isenabled()
    with ManualGC(enabled=True, interval=3) as collector:
        assert not gc.isenabled()
        start = len(collected)  # one collection on entry
        for iteration in range(1, 10):
            collector.step(iteration)
        assert len(collected) - start == 3  # iterations 3, 6, 9
    assert gc.isenabled()
    with ManualGC(enabled=False, interval=3) as collector:
        assert gc.isenabled()
        collector.step(3)


def test_a_rank_out_of_gpu_memory_ends_the_job_with_a_clean_status(
    monkeypatch, tmp_path: Path, capsys
) -> None:
    """torchrun reports rank 2 failed and its log shows CUDA's OOM: exit 1, status oom naming the
    rank, one message with its log and what to try; no traceback."""
    import json

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from offload_runner.config.schema import RunConfig
    from offload_runner.launch import launch
    from offload_runner.plan import planned_peaks

    run_dir = tmp_path / "run"

    def fail(_args) -> None:
        (run_dir / "rank2.log").write_text(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9.27 GiB. GPU 0 has a "
            "total capacity of 139.80 GiB of which 4.21 GiB is free. Of the allocated memory "
            "131.90 GiB is allocated by PyTorch, and 1.2 GiB is reserved\n"
        )
        failure = ProcessFailure(local_rank=2, pid=1, exitcode=1, error_file=str(tmp_path / "x"))
        raise ChildFailedError("offload_runner.worker", {2: failure})

    monkeypatch.setattr(torchrun, "run", fail)
    monkeypatch.delenv("RANK", raising=False)
    assert launch(RunConfig(), {"name": "t"}, [], run_dir) == 1
    assert json.loads((run_dir / "status.json").read_text())["status"] == "oom"
    assert json.loads((run_dir / "status.json").read_text())["rank"] == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "rank 2 ran out of GPU memory" in err and "offload/optimizer=auto" in err
    planned = planned_peaks(RunConfig(), 1)["planned_gpu_peak_gb"]
    assert f"planned peak {planned:.1f} GB, it held 131.9 GB and asked 9.27 GB more" in err
    assert "Traceback" not in err


def _startup_rank(rank: int, world: int, tmp: Path) -> None:
    """Two gloo ranks of one node: only local rank 0 samples the node's RAM."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world
    )
    startup = Startup(is_node_sampler=rank == 0)
    startup.phase("model")
    hold = bytearray(64 * 1024**2)  # the node's RAM in use grows while the run holds memory
    hold[::4096] = b"x" * len(hold[::4096])
    startup.first_step_done()
    startup.sample_host()
    torch.save(startup.gathered(gpu_peak_gb=1.5 + rank), tmp / f"startup{rank}.pt")
    dist.destroy_process_group()


def test_startup_reports_every_ranks_peak_and_the_nodes_ram(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(LAUNCHED_AT_ENV, str(time.time() - 5))
    mp.spawn(_startup_rank, args=(2, tmp_path), nprocs=2)
    report = torch.load(tmp_path / "startup0.pt")
    assert report == torch.load(tmp_path / "startup1.pt")  # every rank knows all
    assert report["gpu_peak_per_rank_gb"] == [1.5, 2.5]
    assert report["gpu_alloc_retries_per_rank"] == [None, None]  # no CUDA: unknown, not 0
    assert 5 <= report["time_to_first_step_s"] < 60  # counted from the launcher's clock
    assert 5 <= time.time() - report["launched_at"] < 60
    assert set(report["startup_s"]) == {"model"}
    (before,), (peak,) = (
        report["host_used_gb_before_per_node"],
        report["host_used_gb_max_per_node"],
    )
    assert 0 < before <= peak


def test_a_failing_rank_logs_its_traceback_and_exits_1_without_printing_it(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """The terminal shows the launcher's one line (rank, log, fix), not torch's traceback: the
    rank writes it to its log and exits 1."""
    import logging

    from offload_runner import train, worker
    from tests.conftest import compose_run

    def out_of_memory(run, run_dir):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(train, "train", out_of_memory)
    logger, root = logging.getLogger("offload_runner"), logging.getLogger()
    # earlier tests' handlers, here and on the root logger, may write to streams closed by now
    handlers, propagate = list(logger.handlers), logger.propagate
    saved_root = list(root.handlers), root.level
    logger.handlers.clear()
    logger.propagate = False
    try:
        worker.setup_rank_logging(tmp_path, 0)  # as worker.main does, before _train
        assert worker._train(compose_run("recipe=tiny"), tmp_path, 0) == 1
    finally:
        logging.captureWarnings(False)
        logger.handlers[:], logger.propagate = handlers, propagate
        root.handlers[:], root.level = saved_root
    log = (tmp_path / "rank0.log").read_text()
    assert "CUDA out of memory" in log and "Traceback" in log
    assert "OutOfMemoryError: CUDA out of memory" not in capsys.readouterr().err
