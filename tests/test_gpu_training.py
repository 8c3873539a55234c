"""Real training on the GPU (marked ``gpu``; skipped without CUDA): the tiny dense recipe through
the CLI, as a user runs it, in deterministic mode.

- the same seed twice gives identical losses;
- activation offload gives the baseline's losses; optimizer-state offload gives them bit for bit
  (windowed: the same Transformer Engine Adam kernel on the same fp32 numbers, piece by piece;
  with the masters as remainders, those of Megatron-Core's precision-aware optimizer, which keeps
  them so too), and its step holds only the window of the states, not all of them;
- a run resumed from a checkpoint continues the uninterrupted run within 1e-3: optimizer on the
  GPU, its states offloaded, and half of it on the CPU (HybridDeviceOptimizer, which needs
  offload.optimizer.restore_after_load: without it, max |Δloss| was 3.5e-2 after resume);
- the CPU-Adam engine gives HybridDeviceOptimizer 100%'s losses (exact mode, landing during the
  next forward or within the step; a dense model and a MoE one), and its delayed
  mode is exact until the warmup ends, then one step stale (copying during the backward or at
  the step boundary); both resume (delayed mode with and
  without weight prediction), and a checkpoint moves between it and HybridDeviceOptimizer 100%
  both ways;
- on two GPUs, context parallelism (each sequence split over both) tracks data parallelism (the
  batch split over both) on the same global batch;
- the terminal of a run (tiny, and the proxy page-locking its states) shows none of Megatron-Core's
  or Transformer Engine's warnings, which rank0.log keeps.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import torch

from offload_runner.rundir import rank_log
from tests.conftest import LIBRARY_NOISE, run_cli

pytestmark = pytest.mark.gpu

ITERS = 8
BASE = (
    f"train.train_iters={ITERS}",
    "model.deterministic_mode=true",
    "scheduler.lr_warmup_iters=2",
)
RESUME_TOLERANCE = 1e-3
# Ring attention adds the two halves of each softmax in another order than one kernel does.
CONTEXT_PARALLEL_TOLERANCE = 1e-2


def train(out: Path, *overrides: str, recipe: str = "tiny") -> dict:
    """Run the CLI on ``recipe`` into ``out`` and return its summary.json."""
    result = run_cli("--recipe", recipe, *BASE, *overrides, f"output_dir={out}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@cache
def baseline(root: str) -> dict:
    return train(Path(root) / "baseline")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("gpu"))


# exact CPU Adam with no GPU share: the whole update on the CPU
ALL_ON_CPU = ("offload/optimizer=cpu_adam", "optimizer.cpu_adam_gpu_share=0")
# the GPU share's tests: 20 iterations
SHARE_ITERS = ("train.train_iters=20",)


@cache
def all_on_cpu(root: str) -> dict:
    """Exact CPU Adam, all on the CPU, over the GPU share tests' iterations."""
    return train(Path(root) / "share-cpu", *SHARE_ITERS, *ALL_ON_CPU)


@cache
def adam_kernels(root: str) -> float:
    """How far torch's fused AdamW on the CPU and on the GPU part the losses there."""
    on_gpu = train(
        Path(root) / "share-none",
        *SHARE_ITERS,
        "offload/optimizer=cpu_adam",
        "optimizer.optimizer_offload_fraction=1e-6",
    )
    return max_delta(all_on_cpu(root)["losses"], on_gpu["losses"])


def max_delta(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_same_seed_twice_is_identical(root: str) -> None:
    again = train(Path(root) / "again")
    assert again["losses"] == baseline(root)["losses"]
    # the plan beside what the run measured
    assert again["planned_gpu_peak_gb"] > 0 and again["planned_host_gb"] > 0


def test_activation_offload_tracks_baseline(root: str) -> None:
    run = train(
        Path(root) / "act", "offload/activation=enabled", "model.cpu_offloading_num_layers=2"
    )
    assert max_delta(run["losses"], baseline(root)["losses"]) < 1e-3


@pytest.mark.parametrize("masters", ["remainders", "fp32"])
def test_state_offload_matches_baseline_and_moves_the_states(root: str, masters: str) -> None:
    """The masters as remainders (the default: Transformer Engine's remainder kernel, 10 B/param
    each way) give Megatron-Core's precision-aware optimizer's losses bit for bit, which keeps
    them so too; fp32 masters (optimizer.store_param_remainders=false, 12 B/param) the plain
    baseline's."""
    fp32 = masters == "fp32"
    run = train(
        Path(root) / f"states-{masters}",
        "offload/optimizer=states",
        "optimizer.optimizer_state_offload_chunk_size_mb=1",
        f"optimizer.store_param_remainders={str(not fp32).lower()}",
    )
    base = (
        baseline(root)
        if fp32
        else train(
            Path(root) / "baseline-precision-aware", "optimizer.use_precision_aware_optimizer=true"
        )
    )
    assert run["losses"] == base["losses"]
    assert run["states_master_bytes"] == (4 if fp32 else 2)
    assert run["host_pinned_gb_max"] > 0 and run["states_link_gb_per_s"] > 0
    # one GPU: the pass ran beside the forward, whose thread's waits for it were timed
    assert run["states_beside_forward_s"] is not None
    assert run["states_forward_wait_s_median"] is not None
    # forward/backward runs without the masters and Adam states (10 or 12 B/param) but for the
    # 4 MiB window of the pass that runs beside the next forward (the slots the last backward
    # grew go as soon as their pieces are out), and the step adds that window to what
    # forward+backward freed (where the last backward's pieces came in), not all of them
    states_gb = (8 + run["states_master_bytes"]) * run["states_offloaded_params"] / 1024**3
    window_gb = run["states_window_gb"]
    assert run["gpu_peak_fwd_bwd_gb"] < base["gpu_peak_fwd_bwd_gb"] - states_gb / 2 + window_gb
    assert run["gpu_peak_step_gb"] <= run["gpu_peak_fwd_bwd_gb"] + window_gb


@pytest.mark.parametrize("masters", ["remainders", "bf16"])
def test_8bit_moments_track_state_offload_and_move_a_byte_each(root: str, masters: str) -> None:
    """8-bit moments through 1 MiB pieces of the window (the codes and their blocks' scales on
    the streams): the losses stay near bf16-gradient state offload's, with or without masters
    (stochastically rounded bf16 parameters), and the host holds 1.016 B per moment."""
    low = ("offload/optimizer=states", "optimizer.optimizer_state_offload_chunk_size_mb=1")
    grads = ("ddp.grad_reduce_in_fp32=false",)
    base = train(Path(root) / "states-bf16-grads", *low, *grads)
    run = train(
        Path(root) / f"q8-{masters}",
        *low,
        *grads,
        "optimizer.exp_avg_dtype=q8",
        "optimizer.exp_avg_sq_dtype=q8",
        f"optimizer.main_params_dtype={'bf16' if masters == 'bf16' else 'fp32'}",
    )
    assert max_delta(run["losses"], base["losses"]) < 0.05
    assert run["losses"][-1] < run["losses"][0]
    assert run["states_master_bytes"] == (0 if masters == "bf16" else 2)
    per_param = run["states_host_gb"] * 1024**3 / run["states_offloaded_params"]
    # blocks start at each piece: a piece's last block is partial but keeps a whole scale
    assert per_param == pytest.approx(run["states_master_bytes"] + 2 * (1 + 4 / 256), abs=5e-3)


@pytest.mark.parametrize("masters", ["fp32", "bf16"])
def test_8bit_moments_resume_bit_for_bit(root: str, masters: str) -> None:
    """8-bit moments (with remainders, or with stochastically rounded bf16 masters) saved as
    they are, their scales and the random state beside them: the resumed run's losses are the
    uninterrupted run's exactly."""
    q8 = (
        "offload/optimizer=states",
        "ddp.grad_reduce_in_fp32=false",
        "optimizer.exp_avg_dtype=q8",
        "optimizer.exp_avg_sq_dtype=q8",
        f"optimizer.main_params_dtype={masters}",
    )
    assert_resume_continues(root, q8, tolerance=0.0)


RING = ("offload/weight=enabled", "model.cpu_offloading_num_layers=2")
WEIGHTS = ("offload/optimizer=states", *RING)


@pytest.mark.parametrize("clip", ["0", "1.0"])
def test_weight_offload_matches_state_offload(root: str, clip: str) -> None:
    """Two of tiny's four layers on the host, streamed through the ring, over 20 iterations of
    two micro-batches, beside state offload alone, and forward+backward without their weights and
    gradients. Without clipping the losses are the same bit for bit (the offloaded layers' update
    runs the same TE Adam kernel on the same sums); with it (tiny's norms are 2-3, so clipping
    acts every step) the global norm adds the host's part in another order than Megatron-Core's
    one multi-tensor norm: its last bit moved the losses by 3e-5 at iteration 3 and by more than
    1e-3 by iteration 20 (H100, 9b205a6 and 4d1edf0), as any two norm orders would."""
    # fp32 masters in both (weight offload keeps its layers' so: rounded to nearest even)
    iters = (
        "train.train_iters=20",
        f"optimizer.clip_grad={clip}",
        "optimizer.store_param_remainders=false",
    )
    states = train(Path(root) / f"weights-base-{clip}", *iters, "offload/optimizer=states")
    run = train(Path(root) / f"weights-{clip}", *iters, *WEIGHTS)
    assert run["weight_offload_layers"] == 2 and run["weight_offload_params"] > 0
    if clip == "0":
        assert run["losses"] == states["losses"]
    assert max_delta(run["losses"], states["losses"]) < 5e-2
    assert run["gpu_peak_fwd_bwd_gb"] < states["gpu_peak_fwd_bwd_gb"]


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(("offload/optimizer=states", "offload/activation=enabled"), id="activations"),
        pytest.param(
            (
                "offload/optimizer=states",
                "model.recompute_granularity=full",
                "model.recompute_method=uniform",
                "model.recompute_num_layers=1",
            ),
            id="full-recompute",
        ),
        pytest.param(("offload/optimizer=cpu_adam",), id="cpu-adam"),
    ],
)
def test_weight_offload_composes(root: str, extra: tuple[str, ...]) -> None:
    """With activation offload (the seeds' "both"), full recompute (the layer's forward runs
    again inside backward) and the CPU-Adam engine: without clipping (whose norm order differs,
    see above), the losses of the same run without weight offload. The CPU-Adam engine's CPU
    kernel rounds otherwise than the GPU's, which updates the offloaded layers there: the first
    update's bf16 weights agree, then last bits flip bf16 roundings and the losses part by a few
    1e-3, as the engine's own against GPU Adam (1.05e-3 by iteration 8, H100, 0357a3d)."""
    name = "-".join(o.split("=")[-1] for o in extra)
    # fp32 masters for state offload: weight offload rounds its layers' to nearest even
    extra = (*extra, "optimizer.clip_grad=0", "optimizer.store_param_remainders=false")
    base = train(Path(root) / f"wbase-{name}", *extra)
    run = train(Path(root) / f"w-{name}", *RING, *extra)
    if "offload/optimizer=cpu_adam" in extra:
        assert run["losses"][:2] == base["losses"][:2]
        assert max_delta(run["losses"], base["losses"]) < 5e-3
    else:
        assert run["losses"] == base["losses"]


def test_cpu_adam_matches_hybrid_device_optimizer_and_reports_its_rate(root: str) -> None:
    """Exact mode, the whole Adam step on the CPU, over 20 iterations: the same losses as
    Megatron-Core's HybridDeviceOptimizer at 100% (both run torch's fused AdamW on fp32 masters
    on the CPU), and the same first losses as GPU Adam, whether Transformer Engine's FusedAdam
    (the no-offload run) or torch's fused AdamW on the GPU (the engine at a fraction that
    leaves every param there). Later the GPU kernels' last-bit differences flip bf16 roundings
    of the weights and the losses part by a few 1e-3 (docs/evidence/
    cpu-vs-gpu-fused-adamw-tiny.txt), as HybridDeviceOptimizer's do."""
    iters = ("train.train_iters=20",)
    base = train(Path(root) / "base20", *iters)
    hdo = train(Path(root) / "hdo100", *iters, "offload/optimizer=cpu_100")
    run = train(Path(root) / "cpu-adam", *iters, *ALL_ON_CPU)
    on_gpu = train(
        Path(root) / "cpu-adam-none",
        *iters,
        "offload/optimizer=cpu_adam",
        "optimizer.optimizer_offload_fraction=1e-6",
    )
    delta = max_delta(run["losses"], base["losses"])
    gpu_delta = max_delta(run["losses"], on_gpu["losses"])
    print(
        f"cpu_adam vs torch's fused AdamW on the GPU: max |Δloss| {gpu_delta:.2e}; vs GPU Adam "
        f"(TE FusedAdam): {delta:.2e}; vs HDO 100%: "
        f"{max_delta(run['losses'], hdo['losses']):.2e}; {run['cpu_adam_params_per_s']:.3g} "
        f"params/s on {run['cpu_adam_threads']} threads"
    )
    assert on_gpu.get("cpu_offloaded_params", 0) == 0
    assert run["losses"] == hdo["losses"]
    assert run["cpu_adam_lands_in_forward"]  # one GPU: the next forward waits module by module
    assert run["losses"][:2] == on_gpu["losses"][:2]  # the first update: the same bf16 weights
    assert max_delta(run["losses"][:3], base["losses"][:3]) < 1e-3
    assert delta <= max_delta(hdo["losses"], base["losses"])
    assert run["cpu_offloaded_params"] > 0 and run["cpu_adam_params_per_s"] > 0
    assert run["host_pinned_gb_max"] > 0 and run["cpu_adam_params_on_gpu"] == 0


def test_cpu_adam_gpu_share_splits_the_update_between_cpu_and_gpu(root: str) -> None:
    """Exact mode's GPU share (balanced each step, the default): pieces of 4 MiB, so the tiny
    model's shard splits; the CPU updates the first pieces in forward order while the GPU
    updates the rest over states streamed through the window. The losses start as the all-CPU
    run's and stay within twice what torch's fused AdamW on the GPU parts from it by (both
    kernels' last-bit differences flip bf16 roundings, here on different elements)."""
    cpu, kernels = all_on_cpu(root), adam_kernels(root)
    shared = train(Path(root) / "share-balanced", *SHARE_ITERS, "offload/optimizer=cpu_adam")
    fixed = train(
        Path(root) / "share-fixed",
        *SHARE_ITERS,
        "offload/optimizer=cpu_adam",
        "optimizer.cpu_adam_gpu_share=0.5",
    )
    print(
        f"GPU share {shared['cpu_adam_gpu_share']:.2f} (balanced), "
        f"{fixed['cpu_adam_gpu_share']:.2f} (0.5): max |Δloss| against all on the CPU "
        f"{max_delta(shared['losses'], cpu['losses']):.2e} / "
        f"{max_delta(fixed['losses'], cpu['losses']):.2e}; CPU against GPU Adam {kernels:.2e}; "
        f"window {shared['cpu_adam_stream_params_per_s']:.3g} params/s"
    )
    for run in (shared, fixed):
        assert run["cpu_adam_params_on_cpu"] > 0 and run["cpu_adam_params_on_gpu"] > 0
        assert run["cpu_offloaded_params"] == cpu["cpu_offloaded_params"]
        assert max_delta(run["losses"][:3], cpu["losses"][:3]) < 1e-3
        assert max_delta(run["losses"], cpu["losses"]) <= 2 * max(kernels, 1e-3)
        assert run["cpu_adam_stream_s_median"] > 0
    assert abs(fixed["cpu_adam_gpu_share"] - 0.5) < 0.2  # whole pieces of 4 MiB


def test_cpu_adam_moe_engines_share_the_worker_and_match_hybrid_device_optimizer(
    root: str,
) -> None:
    """A MoE model: one engine for the dense shard, one for the experts', sharing the worker and
    landing during the forward; the same losses as HybridDeviceOptimizer 100%."""
    hdo = train(Path(root) / "moe-hdo100", "offload/optimizer=cpu_100", recipe="tiny_moe")
    run = train(Path(root) / "moe-cpu-adam", *ALL_ON_CPU, recipe="tiny_moe")
    assert run["cpu_adam_lands_in_forward"] and run["cpu_adam_pieces"] >= 2
    assert run["losses"] == hdo["losses"]


def test_cpu_adam_delayed_lands_one_step_late(root: str) -> None:
    """Delayed mode: exact until the warmup ends (identical losses), then one step stale."""
    run = train(Path(root) / "cpu-adam-delayed", "offload/optimizer=cpu_adam_delayed")
    base = baseline(root)
    exact = 2  # scheduler.lr_warmup_iters: step 3's update is the first delayed one, so step 4's
    # forward (and loss) is the first without the previous update
    assert max_delta(run["losses"][: exact + 1], base["losses"][: exact + 1]) < 1e-3
    assert run["losses"][exact + 1 :] != base["losses"][exact + 1 :]
    assert run["final_loss"] < run["first_loss"]
    # one GPU: every piece's copies ran during the last micro-batch's backward (at the step
    # boundary under data parallelism: the two-GPU tests)
    assert run["cpu_adam_copies_in_backward"]
    assert run["cpu_adam_pieces_in_backward"] == run["cpu_adam_pieces"]


# delayed mode with its GPU share balanced each step (the tiny model's shard splits between the
# CPU and the window)
DELAYED_SHARE = ("offload/optimizer=cpu_adam_delayed", "optimizer.cpu_adam_gpu_share=null")


def test_cpu_adam_delayed_gpu_share_runs_part_of_each_late_update_on_the_gpu(root: str) -> None:
    """Delayed mode with a GPU share: each delayed update's last pieces (those the next
    backward lands last) pass through the window on a side stream under the next
    forward+backward, their gradients streamed up with the states, the rest on the CPU. Exact
    until the warmup ends, then the all-CPU delayed run's losses within twice what the two Adam
    kernels part them by."""
    cpu = train(Path(root) / "late-cpu", *SHARE_ITERS, "offload/optimizer=cpu_adam_delayed")
    kernels = adam_kernels(root)
    shared = train(Path(root) / "late-shared", *SHARE_ITERS, *DELAYED_SHARE)
    delta = max_delta(shared["losses"], cpu["losses"])
    print(
        f"delayed, GPU share {shared['cpu_adam_gpu_share']:.2f} (balanced): max |Δloss| "
        f"against all on the CPU {delta:.2e}; CPU against GPU Adam {kernels:.2e}"
    )
    assert cpu["cpu_adam_params_on_gpu"] == 0 and cpu["cpu_adam_mode"] == "delayed"
    assert shared["cpu_adam_params_on_cpu"] > 0 and shared["cpu_adam_params_on_gpu"] > 0
    assert shared["cpu_adam_mode"] == "delayed" and shared["cpu_adam_copies_in_backward"]
    assert max_delta(shared["losses"][:4], cpu["losses"][:4]) < 1e-3
    assert delta <= 2 * max(kernels, 1e-3)
    assert shared["final_loss"] < shared["first_loss"]


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() != 2, reason="needs exactly two GPUs")


@TWO_GPUS
@pytest.mark.parametrize("engine", ["states", "cpu_adam"])
def test_resume_under_expert_parallelism(root: str, engine: str) -> None:
    """The exact host engines on a MoE model over two GPUs (EP2: the experts' optimizer part on
    each rank, the dense part's shard over both): resume continues the uninterrupted run."""
    assert_resume_continues(root, ("parallel=ep2", f"offload/optimizer={engine}"), "tiny_moe")


@TWO_GPUS
def test_cpu_adam_delayed_experts_keeps_the_dense_part_exact_and_resumes(root: str) -> None:
    """optimizer.cpu_adam_delayed_scope=experts on a MoE model over two GPUs (EP2, so the
    experts have their own optimizer part): every state on the host, the experts' updates one
    step late after the warmup, the dense part's exact (with its GPU share); exact mode's losses
    until then; resume continues the run."""
    experts = ("parallel=ep2", "offload/optimizer=cpu_adam_delayed_experts")
    exact = train(
        Path(root) / "moe-exact", "parallel=ep2", "offload/optimizer=cpu_adam", recipe="tiny_moe"
    )
    run = train(Path(root) / "moe-delayed-experts", *experts, recipe="tiny_moe")
    assert run["cpu_adam_mode"] == "delayed experts"
    assert 0 < run["cpu_adam_delayed_params"] < run["cpu_offloaded_params"]
    assert run["cpu_offloaded_params"] == exact["cpu_offloaded_params"]
    assert run["cpu_adam_params_on_gpu"] > 0
    warmup = 2  # scheduler.lr_warmup_iters: step 4's forward is the first with a stale expert
    assert max_delta(run["losses"][: warmup + 1], exact["losses"][: warmup + 1]) < 1e-3
    assert run["losses"][warmup + 1 :] != exact["losses"][warmup + 1 :]
    assert run["final_loss"] < run["first_loss"]
    ckpt, half = Path(root) / "ckpt-moe-delayed-experts", ITERS // 2
    train(
        Path(root) / "first-moe-delayed-experts",
        *experts,
        f"train.train_iters={half}",
        f"checkpoint.save={ckpt}",
        f"scheduler.lr_decay_iters={ITERS}",
        recipe="tiny_moe",
    )
    resumed = train(
        Path(root) / "resumed-moe-delayed-experts",
        *experts,
        f"checkpoint.load={ckpt}",
        recipe="tiny_moe",
    )
    delta = max_delta(resumed["losses"], run["losses"][half:])
    print(f"delayed experts, resumed vs uninterrupted: max |Δloss| {delta:.2e}")
    assert delta < RESUME_TOLERANCE


@pytest.mark.parametrize(
    "offload",
    [
        pytest.param((), id="gpu-adam"),
        pytest.param(("offload/optimizer=states",), id="states"),
        pytest.param(("offload/optimizer=cpu_50",), id="hybrid-50"),
        pytest.param(("offload/optimizer=cpu_adam",), id="cpu-adam"),
        pytest.param(("offload/optimizer=cpu_adam_delayed",), id="cpu-adam-delayed"),
        pytest.param(DELAYED_SHARE, id="cpu-adam-delayed-gpu-share"),
        # the first landing after the load extrapolates from Adam's state
        pytest.param(
            ("offload/optimizer=cpu_adam_delayed", "optimizer.cpu_adam_weight_prediction=true"),
            id="cpu-adam-delayed-predicting",
        ),
        # the exact columns' selection and GPU state come back from the checkpoint
        pytest.param(
            ("offload/optimizer=cpu_adam_delayed", "optimizer.cpu_adam_exact_columns=0.1"),
            id="cpu-adam-delayed-columns",
        ),
        pytest.param(
            ("offload/optimizer=cpu_adam", "optimizer.optimizer_offload_fraction=0.5"),
            id="cpu-adam-50",
        ),
        pytest.param(ALL_ON_CPU, id="cpu-adam-all-on-cpu"),
        pytest.param(WEIGHTS, id="weights"),
        pytest.param(("parallel=cp2", "offload/optimizer=states"), id="cp2-states", marks=TWO_GPUS),
        # interleaved pipeline: two model chunks per rank, checkpoint keys model0/model1,
        # every data-parallel rank writing its share
        pytest.param(
            (
                "model.num_layers=4",
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2",
                "checkpoint.fully_parallel_save=true",
            ),
            id="pp2-vpp2",
            marks=TWO_GPUS,
        ),
    ],
)
def test_resume_continues_the_uninterrupted_run(root: str, offload: tuple[str, ...]) -> None:
    assert_resume_continues(root, offload)


def assert_resume_continues(
    root: str, offload: tuple[str, ...], recipe: str = "tiny", tolerance: float = RESUME_TOLERANCE
) -> None:
    """Half the run, saved; resumed from there: the second half's losses are the uninterrupted
    run's within ``tolerance``."""
    name = "-".join(o.split("=")[-1] for o in offload) or "plain"
    name = f"{recipe}-{name}" if recipe != "tiny" else name
    ckpt = Path(root) / f"ckpt-{name}"
    full = train(Path(root) / f"full-{name}", *offload, recipe=recipe)
    half = ITERS // 2
    train(
        Path(root) / f"first-{name}",
        *offload,
        f"train.train_iters={half}",
        f"checkpoint.save={ckpt}",
        f"scheduler.lr_decay_iters={ITERS}",
        recipe=recipe,
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(half)
    resumed = train(
        Path(root) / f"resumed-{name}", *offload, f"checkpoint.load={ckpt}", recipe=recipe
    )
    assert resumed["iterations"] == ITERS - half
    delta = max_delta(resumed["losses"], full["losses"][half:])
    print(f"{name}, resumed vs uninterrupted: max |Δloss| {delta:.2e}")
    assert delta <= tolerance


@pytest.mark.parametrize(
    ("saved_with", "loaded_with"),
    [("cpu_100", "cpu_adam"), ("cpu_adam", "cpu_100"), ("states", "cpu_adam")],
    ids=["hybrid-to-cpu-adam", "cpu-adam-to-hybrid", "states-to-cpu-adam"],
)
def test_checkpoint_moves_between_hybrid_and_cpu_adam(
    root: str, saved_with: str, loaded_with: str
) -> None:
    """HybridDeviceOptimizer, the CPU-Adam engine and the windowed state offload store Adam in
    HybridDeviceOptimizer's layout at 100% (fp32 master, exp_avg, exp_avg_sq on the host; the
    step in the param groups): a checkpoint of one resumes in another and continues the
    uninterrupted run of the first."""
    ckpt = Path(root) / f"ckpt-{saved_with}-{loaded_with}"
    half = ITERS // 2
    full = train(Path(root) / f"full-x-{saved_with}", f"offload/optimizer={saved_with}")
    train(
        Path(root) / f"first-x-{saved_with}",
        f"offload/optimizer={saved_with}",
        f"train.train_iters={half}",
        f"checkpoint.save={ckpt}",
        f"scheduler.lr_decay_iters={ITERS}",
    )
    resumed = train(
        Path(root) / f"resumed-x-{loaded_with}",
        f"offload/optimizer={loaded_with}",
        f"checkpoint.load={ckpt}",
    )
    delta = max_delta(resumed["losses"], full["losses"][half:])
    print(f"{saved_with} -> {loaded_with}: max |Δloss| {delta:.2e}")
    assert delta < RESUME_TOLERANCE


def test_a_profiled_run_writes_its_trace_and_summary(root: str) -> None:
    """profiling.use_pytorch_profiler: the window's trace, its ops table and the trace's summary,
    whose GPU kernels took part of the window (the summary's first line in the rank's log)."""
    out = Path(root) / "profiled"
    window = ("profiling.profile_step_start=4", "profiling.profile_step_end=5")
    train(out, "profiling.use_pytorch_profiler=true", *window)
    summary = (out / "profile/rank0-summary.txt").read_text().splitlines()
    busy = re.match(r"window ([\d.]+) ms, kernels busy ([\d.]+) ms \((\d+)%\)", summary[1])
    assert busy and 0 < float(busy[2]) < float(busy[1]), summary[1]
    assert (out / "profile/rank0.json.gz").stat().st_size > 0
    assert summary[1] in rank_log(out, 0).read_text()


def test_tensorboard_event_file_of_a_real_run(root: str) -> None:
    """logger.tensorboard_dir: loss, step time and GPU memory of every iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = Path(root) / "tensorboard"
    train(Path(root) / "tb-run", f"logger.tensorboard_dir={board}")
    events = EventAccumulator(str(board))
    events.Reload()
    for tag in ("lm loss", "time/step_s", "memory/gpu_peak_allocated_gb"):
        assert len(events.Scalars(tag)) == ITERS, tag


def test_wandb_offline_run_of_a_real_run(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """logger.wandb_project with WANDB_MODE=offline: the run is written for `wandb sync`."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    saved = Path(root) / "wandb-saved"
    train(
        Path(root) / "wandb-run",
        "logger.wandb_project=offload-runner",
        f"logger.wandb_save_dir={saved}",
    )
    (run,) = (saved / "wandb").glob("offline-run-*")
    history = next(run.glob("*.wandb")).read_bytes()
    for tag in (b"lm loss", b"time/step_s", b"memory/gpu_peak_allocated_gb"):
        assert tag in history, tag


@TWO_GPUS
def test_context_parallel_tracks_data_parallel(root: str) -> None:
    cp = train(Path(root) / "cp2", "parallel=cp2")
    base = baseline(root)  # all visible GPUs: DP2 on the same global batch
    assert cp["world_size"] == base["world_size"] == 2
    delta = max_delta(cp["losses"], base["losses"])
    print(f"CP2 vs DP2: max |Δloss| {delta:.2e} over {ITERS} iterations")
    assert delta < CONTEXT_PARALLEL_TOLERANCE


EVAL = ("validation.eval_iters=2", "validation.eval_interval=4")


def _folder(offload: tuple[str, ...]) -> str:
    return "-".join(o.rpartition("=")[2] for o in offload) or "none"  # no '=' in a path


@pytest.mark.parametrize(
    "offload",
    [(), ("offload/optimizer=states",), ("offload/optimizer=cpu_adam_delayed",)],
    ids=["no-offload", "states", "cpu-adam-delayed"],
)
def test_evaluation_on_the_held_out_split(root: str, offload: tuple[str, ...]) -> None:
    """validation.eval_iters: the held-out loss every eval_interval iterations and after the
    last, beside (and not changing) the training curve: the states' pass beside the forward
    and delayed CPU Adam's update in flight land first, and evaluation arms no engine copy for
    a backward that never comes."""
    summary = train(Path(root) / f"eval-{_folder(offload)}", *EVAL, *offload)
    curve = summary["validation_losses"]
    assert [i for i, _ in curve] == [4, ITERS]
    assert summary["final_validation_loss"] == curve[-1][1]
    alone = train(Path(root) / f"no-eval-{_folder(offload)}", *offload) if offload else None
    assert summary["losses"] == (alone or baseline(root))["losses"]


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("tiny", BASE),
        ("qwen3_30b_a3b_proxy", ("train.train_iters=3", "offload/optimizer=states")),
    ],
    ids=["tiny", "proxy-states"],
)
def test_the_terminal_shows_no_library_warnings(root: str, recipe: str, extra: tuple) -> None:
    """Python's warnings on (PYTHONWARNINGS=default, not the test helper's ignore): Megatron-Core's
    and TE's warnings land in rank0.log only; the proxy's page-locking (over SAY_GB) is said with
    its size and rate."""
    out = Path(root) / f"quiet-{recipe}"
    args = ("--recipe", recipe, *extra, f"output_dir={out}")
    result = run_cli(*args, env={"PYTHONWARNINGS": "default"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    terminal = result.stdout + result.stderr
    noisy = [line for line in terminal.splitlines() if LIBRARY_NOISE.search(line)]
    logged = [
        line for line in rank_log(out, 0).read_text().splitlines() if LIBRARY_NOISE.search(line)
    ]
    print(f"{recipe}: {len(noisy)} warning lines on the terminal, {len(logged)} in rank0.log")
    print("\n".join(f"  log: {line[:160]}" for line in logged[:8]))
    print("\n".join(line for line in terminal.splitlines() if "page-lock" in line))
    assert not noisy, noisy[:5]
    assert logged
    if recipe != "tiny":
        assert re.search(r"page-locking \d+\.\d GB .*page-locked in [\d.]+ s", terminal, re.S)
