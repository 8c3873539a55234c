#!/usr/bin/env python
"""Run the offload benchmark matrix on a GPU machine, and render docs/BENCHMARKS.md from it.

    # on the GPU machine (one suite per call; each case is a real run_recipe.py training run)
    python bench/run_benchmarks.py run --suite proxy-1 --out results-proxy-1.json
    # anywhere: the Markdown report from one or more result files
    python bench/run_benchmarks.py report results-*.json > docs/BENCHMARKS.md

Every number in the report comes from the runs' own summary.json / metrics.jsonl; the result
file also records the command of each case, the GPU, and the package versions.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import throughput  # noqa: E402
from calibrate_planner import is_whole_states, plan_of  # noqa: E402

from offload_runner.hardware import fused_adamw_rate, rank_link_gb_per_s  # noqa: E402
from offload_runner.launch import OOM_MARKERS  # noqa: E402
from offload_runner.report import fmt, markdown_table, max_abs_delta, ratio, saved  # noqa: E402
from offload_runner.rundir import STATUS_FILE, SUMMARY_FILE, read_json  # noqa: E402

ITERS = 20


@dataclass(frozen=True)
class Case:
    name: str
    recipe: str
    overrides: tuple[str, ...] = ()
    baseline: str = "no offload"  # the case this one is compared with
    nproc: int = 1
    # run at the cpu_adam_hidden_fraction this earlier case of the suite reported (the engine
    # finding the largest fraction whose CPU work hides under forward+backward)
    hidden_fraction_of: str = ""

    @property
    def slug(self) -> str:
        """The case name as a folder name Hydra's override grammar accepts."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name).strip("_")

    def command(self, out_dir: Path, iters: int) -> list[str]:
        return [
            sys.executable,
            str(ROOT / "run_recipe.py"),
            "--recipe",
            self.recipe,
            *self.overrides,
            f"train.train_iters={iters}",
            f"output_dir={out_dir / self.slug}",
            f"launcher.nproc_per_node={self.nproc}",
        ]


def _optimizer_cases(recipe: str, extra: tuple[str, ...] = ()) -> list[Case]:
    cases = []
    for pct in (25, 50, 100):
        for overlap in (False, True):
            name = f"HDO {pct}%" + (" + overlap" if overlap else "")
            cases.append(
                Case(
                    name,
                    recipe,
                    (
                        *extra,
                        f"offload/optimizer=cpu_{pct}",
                        f"optimizer.overlap_cpu_optimizer_d2h_h2d={str(overlap).lower()}",
                    ),
                )
            )
    return cases


def _suite(recipe: str, extra: tuple[str, ...], act_layers: int) -> list[Case]:
    return [
        Case("no offload", recipe, extra),
        Case("no offload (repeat)", recipe, extra, baseline="no offload"),
        Case(
            f"activation offload {act_layers} layers",
            recipe,
            (*extra, "offload/activation=enabled", f"model.cpu_offloading_num_layers={act_layers}"),
        ),
        *_optimizer_cases(recipe, extra),
    ]


# The CPU-Adam engine on the proxy at global batch 1 and 4, each beside its no-offload baseline
# and HybridDeviceOptimizer 100% with overlap in the same suite; delayed mode after 2 exact steps.
PROXY_RECIPE = "qwen3_30b_a3b_proxy"
DELAY = ("optimizer.cpu_adam_exact_steps=2",)


def _batch(gbs: int) -> tuple[str, str]:
    """The proxy's batch overrides: global batch ``gbs`` of micro-batch 1."""
    return (f"train.global_batch_size={gbs}", "train.micro_batch_size=1")


def _cpu_adam_cases(
    gbs: int, delayed_fractions: tuple[float, ...] = (), nproc: int = 1
) -> list[Case]:
    batch = _batch(gbs)
    tag = f"DP{nproc} GBS{gbs}" if nproc > 1 else f"GBS{gbs}"
    base = f"{tag} no offload"

    def case(name: str, *overrides: str) -> Case:
        return Case(f"{tag} {name}", PROXY_RECIPE, (*batch, *overrides), base, nproc=nproc)

    return [
        case("no offload"),
        case("HDO 100% + overlap", "offload/optimizer=cpu_100"),
        case("cpu_adam 100%", "offload/optimizer=cpu_adam"),
        case("cpu_adam_delayed 100%", "offload/optimizer=cpu_adam_delayed", *DELAY),
        *(
            case(
                f"cpu_adam_delayed {f:.0%}",
                "offload/optimizer=cpu_adam_delayed",
                *DELAY,
                f"optimizer.optimizer_offload_fraction={f}",
            )
            for f in delayed_fractions
        ),
        replace(
            case(
                "cpu_adam_delayed at its hidden fraction",
                "offload/optimizer=cpu_adam_delayed",
                *DELAY,
            ),
            hidden_fraction_of=f"{tag} cpu_adam_delayed 100%",
        ),
        case("no offload (repeat)"),  # the baseline's own spread within the suite
        # the placement whose convergence stays within the seeds' noise (cpu-adam-conv-7/8)
        case(
            "cpu_adam_delayed experts only",
            "offload/optimizer=cpu_adam_delayed",
            *DELAY,
            EXPERTS_ONLY,
        ),
    ]


# The full 48-layer Qwen3-30B-A3B on one 4-GPU node (nvidia-h200-x4): no offload runs out of GPU
# memory (status oom), the offloads that fit train, and a PP2 layout with optimizer offload.
FULL = (
    "train.global_batch_size=16",
    "train.micro_batch_size=1",
    "planner.gpu_memory_gb=139",
    "planner.host_memory_gb=500",
)
FULL_BASE = "full EP4 no offload"


def _full(name: str, *overrides: str) -> Case:
    return Case(f"full {name}", "qwen3_30b_a3b", (*FULL, *overrides), FULL_BASE, nproc=4)


FULL_4GPU = [
    _full("EP4 no offload", "parallel=ep4"),
    _full(
        "EP4 cpu_adam 50%",
        "parallel=ep4",
        "offload/optimizer=cpu_adam",
        "optimizer.optimizer_offload_fraction=0.5",
    ),
    _full("EP4 HDO 50%", "parallel=ep4", "offload/optimizer=cpu_50"),
    _full("EP4 optimizer states", "parallel=ep4", "offload/optimizer=states"),
    _full(
        "PP2 EP2 cpu_adam 50%",
        "parallel=pp2_ep2",
        "offload/optimizer=cpu_adam",
        "optimizer.optimizer_offload_fraction=0.5",
    ),
]


FULL_RECOMPUTE = (
    "model.recompute_granularity=full",
    "model.recompute_method=uniform",
    "model.recompute_num_layers=1",
)


CONVERGENCE_TAIL = 20  # the final loss: the mean over the last iterations


def expert_share(recipe: str) -> float:
    """The routed experts' share of ``recipe``'s parameters, rounded down to 1e-4: delayed mode
    at this fraction offloads the experts (it fills them first) and keeps the dense part, the
    router among it, exact on the GPU."""
    from offload_runner.config.compose import compose_config, to_run_config
    from offload_runner.model_size import count_parameters

    params = count_parameters(to_run_config(compose_config([f"recipe={recipe}"])).model)
    return math.floor(params.experts / params.total * 1e4) / 1e4


# Delayed mode for the proxy's routed experts alone (composed once: a Hydra composition each)
EXPERTS_ONLY = f"optimizer.optimizer_offload_fraction={expert_share(PROXY_RECIPE)}"


PROFILE_AT = (
    "profiling.use_pytorch_profiler=true",
    "profiling.profile_step_start=5",
    "profiling.profile_step_end=5",
)


# No offload and both exact host engines at 100%: the rows the exact-offload suites compare.
EXACT_ROWS = (
    ("no offload", ()),
    ("cpu_adam 100%", ("offload/optimizer=cpu_adam",)),
    ("states", ("offload/optimizer=states",)),
)


def _cost_cases(gbs: int) -> list[Case]:
    """Exact optimizer offload's cost at one global batch (issue: cost that does not grow with the
    batch): no offload, both exact host engines, and at GBS 4 and 8 HybridDeviceOptimizer 100% and
    delayed mode beside them for comparison; no offload again last (the baseline's own spread)."""
    base = f"cost GBS{gbs} no offload"
    rows = list(EXACT_ROWS)
    if gbs <= 8:
        rows += [
            ("HDO 100% + overlap", ("offload/optimizer=cpu_100",)),
            ("cpu_adam_delayed 100%", ("offload/optimizer=cpu_adam_delayed", *DELAY)),
        ]
    rows.append(("no offload (repeat)", ()))
    return [
        Case(f"cost GBS{gbs} {name}", PROXY_RECIPE, (*_batch(gbs), *extra), base)
        for name, extra in rows
    ]


# The held-out dense shape of the exact-offload issue: llama3_8b at seq 8192, GBS 8, MB 1, with
# offload/optimizer=auto on one H200 (its step and peak beside the GBS 4 run's 4.49 s, 121.7 GB).
LLAMA_AUTO = Case(
    "llama3_8b seq 8192 GBS 8, auto",
    "llama3_8b",
    (
        *_batch(8),
        "scheduler.lr_warmup_iters=2",
        "planner.gpu_memory_gb=139",
        "planner.host_memory_gb=125",
        "offload/optimizer=auto",
    ),
    "llama3_8b seq 8192 GBS 8, auto",
)

DETERMINISTIC = (*_batch(4), "model.deterministic_mode=true")


def _determinism_cases() -> list[Case]:
    """Two identical runs each of no offload and of both exact host engines, deterministic mode:
    each pair's per-iteration losses must be identical."""
    return [
        Case(f"{name}{again}", PROXY_RECIPE, (*DETERMINISTIC, *extra), "no offload")
        for name, extra in EXACT_ROWS
        for again in ("", " (repeat)")
    ]


BF16_MOMENTS = ("optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16")


def _bf16_moment_cases() -> list[Case]:
    """Adam's moments in bf16 (fp32 math) through both host engines beside Transformer Engine's
    FusedAdam with bf16 moments and no offload, deterministic, 20 iterations: the losses agree,
    and state offload moves 8 B/param instead of 12 (its fp32-moment run beside it)."""
    base = "TE FusedAdam bf16 moments, no offload"
    common = (*DETERMINISTIC, "scheduler.lr_warmup_iters=2")
    return [
        Case(name, PROXY_RECIPE, (*common, *extra), base)
        for name, extra in (
            (base, ("optimizer.use_precision_aware_optimizer=true", *BF16_MOMENTS)),
            ("states, bf16 moments", ("offload/optimizer=states", *BF16_MOMENTS)),
            ("cpu_adam, bf16 moments", ("offload/optimizer=cpu_adam", *BF16_MOMENTS)),
            ("states, fp32 moments", ("offload/optimizer=states",)),
        )
    ]


# Qwen3-30B-A3B's first 28 layers (16.8B params) on one GPU of 139 GB with ~125 GB of host RAM:
# no offload runs out of GPU memory; state offload with bf16 moments and gradients keeps 75% of
# the states on the host (the planner's fit for that box).
CAPACITY = (
    "parallel=single",
    "model.num_layers=28",
    *_batch(4),
    "scheduler.lr_warmup_iters=2",
    "planner.gpu_memory_gb=139",
    "planner.host_memory_gb=125",
)
MEANT_NOT_TO_FIT = (
    "full EP4 no offload",
    "full EP2 no offload",
    "28 layers, no offload",
    "llama3_8b under 48 GB, no weight offload",
    "proxy under 12 GB, no weight offload",
    "whole model, no offload",
)


def _capacity_auto(layers: int) -> Case:
    """``offload/optimizer=auto`` on a slice of ``layers`` layers of that box: what the planner
    picks (state-offload fraction, moment and gradient dtypes) is what trains."""
    overrides = tuple(
        f"model.num_layers={layers}" if o.startswith("model.num_layers=") else o for o in CAPACITY
    )
    return Case(
        f"{layers} layers, auto",
        "qwen3_30b_a3b",
        (*overrides, "offload/optimizer=auto"),
        "28 layers, no offload",
    )


# Weight offload (offload/weight=enabled): the dense held-out shape (8 layers of width 2048, seq
# 4096, MB 4) with every layer's weights on the host, and the MoE proxy with all four; each beside
# the same run with its weights on the GPU (optimizer states offloaded in both: weight offload
# needs a host engine).
DENSE_8 = (
    "model.num_layers=8",
    "model.hidden_size=2048",
    "model.ffn_hidden_size=7168",
    "model.num_attention_heads=16",
    "model.num_query_groups=8",
    "model.kv_channels=128",
    "model.seq_length=4096",
    "model.max_position_embeddings=4096",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "scheduler.lr_warmup_iters=2",
    "offload/optimizer=states",
)
PROXY_WEIGHTS = (*_batch(4), "scheduler.lr_warmup_iters=2", "offload/optimizer=states")
WEIGHT_CASES = [
    Case("dense 8 layers, states", "llama3_8b", DENSE_8, "dense 8 layers, states"),
    Case(
        "dense 8 layers, states + weights of 8",
        "llama3_8b",
        (*DENSE_8, "offload/weight=enabled", "model.cpu_offloading_num_layers=8"),
        "dense 8 layers, states",
    ),
    Case("proxy, states", "qwen3_30b_a3b_proxy", PROXY_WEIGHTS, "proxy, states"),
    Case(
        "proxy, states + weights of 4",
        "qwen3_30b_a3b_proxy",
        (*PROXY_WEIGHTS, "offload/weight=enabled", "model.cpu_offloading_num_layers=4"),
        "proxy, states",
    ),
]


# Weight offload's capacity (issue: "fits a 48 / 12 GB GPU" shown on a bigger one, held to that
# size by train.gpu_memory_cap_gb): llama3_8b at seq 8192 with weights, gradients, optimizer state
# and activations on the host, beside the same line without weight offload; the MoE proxy under
# 12 GB (full recompute and bf16 gradients: its logits alone take 3.5 GB), beside it without.
LLAMA_48 = (
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
    "train.gpu_memory_cap_gb=48",
    "planner.host_memory_gb=125",
    "scheduler.lr_warmup_iters=2",
    "offload/optimizer=states",
    "optimizer.optimizer_state_offload_fraction=0.01",
    *BF16_MOMENTS,
    "ddp.grad_reduce_in_fp32=false",
    "offload/activation=enabled",
    "model.cpu_offloading_num_layers=31",
)
PROXY_12 = (
    *PROXY_WEIGHTS,
    "train.gpu_memory_cap_gb=12",
    "planner.host_memory_gb=125",
    "ddp.grad_reduce_in_fp32=false",
    "model.recompute_granularity=full",
    "model.recompute_method=uniform",
    "model.recompute_num_layers=1",
)
WEIGHT_CAP_CASES = [
    Case(
        "llama3_8b under 48 GB, no weight offload",
        "llama3_8b",
        LLAMA_48,
        "llama3_8b under 48 GB, no weight offload",
    ),
    Case(
        "llama3_8b under 48 GB, weights of 31 layers",
        "llama3_8b",
        (*LLAMA_48, "offload/weight=enabled"),
        "llama3_8b under 48 GB, no weight offload",
    ),
    Case(
        "proxy under 12 GB, no weight offload",
        "qwen3_30b_a3b_proxy",
        PROXY_12,
        "proxy under 12 GB, no weight offload",
    ),
    Case(
        "proxy under 12 GB, weights of 4 layers",
        "qwen3_30b_a3b_proxy",
        (*PROXY_12, "offload/weight=enabled", "model.cpu_offloading_num_layers=4"),
        "proxy under 12 GB, no weight offload",
    ),
]


# The llama3_8b line without the cap and without weight offload, every state on the host: its
# losses beside the capped run's (which rise at iterations 6-8 on the mock data).
_UNCAPPED = ("train.gpu_memory_cap_gb", "optimizer.optimizer_state_offload")
LLAMA_UNCAPPED = Case(
    "llama3_8b uncapped, no weight offload",
    "llama3_8b",
    (
        *(o for o in LLAMA_48 if not o.startswith(_UNCAPPED)),
        "optimizer.optimizer_state_offload_fraction=1.0",
    ),
    "llama3_8b uncapped, no weight offload",
)


# The full 48-layer Qwen3-30B-A3B on one two-GPU box (nvidia-h200-x2: 2 x 139 GB, ~250 GB RAM),
# EP2, GBS 8: no offload runs out of GPU memory, offload/optimizer=auto picks what fits both the
# GPUs and the host (one device call each: the model takes minutes to build and pin).
FULL_2 = (
    "parallel=ep2",
    *_batch(8),
    "scheduler.lr_warmup_iters=2",
    "planner.gpu_memory_gb=139",
    "planner.host_memory_gb=250",
)
FULL_2GPU = [
    Case("full EP2 no offload", "qwen3_30b_a3b", FULL_2, "full EP2 no offload", nproc=2),
    Case(
        "full EP2 auto",
        "qwen3_30b_a3b",
        (*FULL_2, "offload/optimizer=auto"),
        "full EP2 no offload",
        nproc=2,
    ),
]


def _two_gpu_engine_cases(gbs: int) -> list[Case]:
    """The exact host engines on two GPUs of one node (the ranks share its cores and its link):
    the proxy data parallel (DP2) and expert parallel (EP2), each beside its own no-offload row."""
    cases = []
    for layout, extra in (("DP2", ()), ("EP2", ("parallel=ep2",))):
        base = f"proxy {layout} GBS{gbs} no offload"
        for name, offload in (
            ("no offload", ()),
            ("cpu_adam", ("offload/optimizer=cpu_adam",)),
            ("states", ("offload/optimizer=states",)),
        ):
            cases.append(
                Case(
                    f"proxy {layout} GBS{gbs} {name}",
                    PROXY_RECIPE,
                    (*_batch(gbs), *extra, *offload),
                    base,
                    nproc=2,
                )
            )
    return cases


# Throughput on the proxy at GBS 16 under a 79 GB cap: Megatron-Core's plain kernels against the
# NVIDIA recipes' fused ones (conf/speed) at micro-batch 1 and 4, a hand sweep of micro-batch x
# no offload / states / full recompute, and auto choosing micro-batch and offload. Run in rounds
# (--rounds, or one call a round) so that every row is measured at least twice, interleaved.
T16 = ("train.global_batch_size=16", "train.gpu_memory_cap_gb=79")
FULL_RECOMPUTE = (
    "model.recompute_granularity=full",
    "model.recompute_method=uniform",
    "model.recompute_num_layers=1",
)


def _throughput_cases() -> list[Case]:
    def case(name: str, *overrides: str) -> Case:
        return Case(name, PROXY_RECIPE, (*T16, *overrides), "MB1 plain")

    return [
        case("MB1 plain", "speed=plain", "train.micro_batch_size=1"),
        case("MB4 plain", "speed=plain", "train.micro_batch_size=4"),
        # a call's fused rows from here (--start-at "MB1 fused" --count 4): two fitted, two not
        case("MB1 fused", "train.micro_batch_size=1"),
        case("MB4 fused", "train.micro_batch_size=4"),
        case("MB2 fused", "train.micro_batch_size=2"),
        case("MB8 fused states", "train.micro_batch_size=8", "offload/optimizer=states"),
        case("MB4 fused full recompute", "train.micro_batch_size=4", *FULL_RECOMPUTE),
        case("auto", "train.micro_batch_size=auto", "offload/optimizer=auto"),
    ]


# Issue 55's acceptance line on one H200: the 37-layer slice at GBS 8, `today` (the kernels of
# 473614f, micro-batch 1, auto's offload) against auto choosing the micro-batch too.
S37 = (
    "parallel=single",
    "model.num_layers=37",
    "train.global_batch_size=8",
    "scheduler.lr_warmup_iters=2",
    "planner.gpu_memory_gb=139",
    "planner.host_memory_gb=125",
)
THROUGHPUT_37 = [
    Case(
        "today",
        "qwen3_30b_a3b",
        (*S37, "speed=plain", "train.micro_batch_size=1", "offload/optimizer=auto"),
        "today",
    ),
    Case(
        "auto",
        "qwen3_30b_a3b",
        (*S37, "train.micro_batch_size=auto", "offload/optimizer=auto"),
        "today",
    ),
]


def _engine_cases(gbs: int, profile: tuple[str, ...] = ()) -> list[Case]:
    """The CPU-Adam engine on the proxy at ``gbs``: exact, delayed and exact with bf16 moments
    (issue 55: delayed <= 0.9x exact, bf16 moments <= 1.0x fp32)."""
    base = f"GBS{gbs} cpu_adam"
    return [
        Case(f"GBS{gbs} {name}", PROXY_RECIPE, (*_batch(gbs), *extra, *profile), base)
        for name, extra in (
            ("cpu_adam", ("offload/optimizer=cpu_adam",)),
            ("cpu_adam_delayed", ("offload/optimizer=cpu_adam_delayed", *DELAY)),
            ("cpu_adam bf16 moments", ("offload/optimizer=cpu_adam", *BF16_MOMENTS)),
        )
    ]


# Where the time goes (issue 55): state offload at MB 8 under the throughput suite's cap, and
# the CPU-Adam engine's three rows at GBS 4, iteration 5 under the torch profiler each.
PROFILE_55 = [
    Case(
        "MB8 fused states",
        PROXY_RECIPE,
        (*T16, "train.micro_batch_size=8", "offload/optimizer=states", *PROFILE_AT),
        "MB8 fused states",
    ),
    *_engine_cases(4, PROFILE_AT),
]


# Issue 55's miss: the state stream at MB 8 against the same shape without offload (no cap:
# it fits one H200 whole), run interleaved.
MB8_STATES = [
    Case(
        "MB8 fused",
        PROXY_RECIPE,
        ("train.global_batch_size=16", "train.micro_batch_size=8"),
        "MB8 fused",
    ),
    Case(
        "MB8 fused states",
        PROXY_RECIPE,
        (*T16, "train.micro_batch_size=8", "offload/optimizer=states"),
        "MB8 fused",
    ),
]


# Issue 56: what each precision and delay step costs in learning, on real text. The corpus:
#   python tools/fetch_corpus.py corpus/text
#   python run_recipe.py --prepare corpus/text --output corpus/prose --vocab-size 16384
# Run with --iters 500 --jobs 9: the rows share one GPU side by side (their losses, not their
# times, are the finding). A second seed of the reference gives the seed-to-seed spread.
CORPUS = "corpus/prose"  # from the project root, where the runs start
CONVERGENCE_RECIPE = "qwen3_moe_small"
REAL_TEXT = (
    "data=indexed",
    f"dataset.data_path=[{CORPUS}]",
    "dataset.split='98,2,0'",
    "validation.eval_iters=10",
    "validation.eval_interval=25",
)


def _convergence_cases() -> list[Case]:
    def case(name: str, *overrides: str) -> Case:
        return Case(name, CONVERGENCE_RECIPE, (*REAL_TEXT, *overrides), "reference")

    experts = f"optimizer.optimizer_offload_fraction={expert_share(CONVERGENCE_RECIPE)}"
    return [
        case("reference"),
        case("reference seed 2", "rng.seed=1235"),
        case("states", "offload/optimizer=states"),
        case("cpu_adam", "offload/optimizer=cpu_adam"),
        case("bf16 moments", "offload/optimizer=states", *BF16_MOMENTS),
        case(
            "bf16 moments and gradients",
            "offload/optimizer=states",
            *BF16_MOMENTS,
            "ddp.grad_reduce_in_fp32=false",
        ),
        case("cpu_adam_delayed", "offload/optimizer=cpu_adam_delayed"),
        case("cpu_adam_delayed experts", "offload/optimizer=cpu_adam_delayed", experts),
        case(
            "cpu_adam_delayed predicted",
            "offload/optimizer=cpu_adam_delayed",
            "optimizer.cpu_adam_weight_prediction=true",
        ),
        case("HDO 50%", "offload/optimizer=cpu_50"),
        # issue 58: state offload's lowest precision steps, as auto takes them
        case("8bit moments", "offload/optimizer=states", *Q8_MOMENTS),
        case(
            "8bit moments, sr bf16 masters",
            "offload/optimizer=states",
            *Q8_MOMENTS,
            "optimizer.main_params_dtype=bf16",
        ),
    ]


Q8_MOMENTS = (
    "optimizer.exp_avg_dtype=q8",
    "optimizer.exp_avg_sq_dtype=q8",
    "ddp.grad_reduce_in_fp32=false",
)
# Issue 56: the expert-delayed mode where it is offered (experts split over ranks), beside its own
# reference on the same two GPUs
CONVERGENCE_EP2 = [
    Case("reference EP2", CONVERGENCE_RECIPE, (*REAL_TEXT, "parallel=ep2"), "reference", nproc=2),
    Case(
        "cpu_adam_delayed_experts EP2",
        CONVERGENCE_RECIPE,
        (*REAL_TEXT, "parallel=ep2", "offload/optimizer=cpu_adam_delayed_experts"),
        "reference EP2",
        nproc=2,
    ),
]
# Issue 58: the whole Qwen3-30B-A3B (48 layers) on one H200, auto's offload against none.
WHOLE = (
    "parallel=single",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "scheduler.lr_warmup_iters=2",
    "planner.gpu_memory_gb=139",
    "planner.host_memory_gb=125",
)
WHOLE_MODEL = [
    Case("whole model auto", "qwen3_30b_a3b", (*WHOLE, "offload/optimizer=auto"), "whole model"),
    Case("whole model, no offload", "qwen3_30b_a3b", WHOLE, "whole model"),
]


# The suites a session may run again (earlier suites' results stay in bench/results and render
# as they ran: the report needs no definition of them).
SUITES: dict[str, list[Case]] = {
    # issue 55: kernels, micro-batch and auto; the 37-layer slice; the CPU-Adam engine's modes
    "throughput-16": _throughput_cases(),
    "throughput-37": THROUGHPUT_37,
    "convergence": _convergence_cases(),
    "convergence-ep2": CONVERGENCE_EP2,
    "whole-model": WHOLE_MODEL,
    "profile-55": PROFILE_55,
    "mb8-states": MB8_STATES,
    **{f"engines-{gbs}": _engine_cases(gbs) for gbs in (4, 8)},
    # exact offload's cost against the batch (no offload, both exact engines, HDO, delayed)
    **{f"gbs-{gbs}": _cost_cases(gbs) for gbs in (4, 8, 32)},
    "cpu-adam-4": _cpu_adam_cases(4),
    "bf16-moments": _bf16_moment_cases(),
    "determinism": _determinism_cases(),
    "tiny": _suite("tiny", ("model.deterministic_mode=true",), 2),
    # capacity: the largest slice of Qwen3-30B-A3B one H200 box trains; the whole model on two
    "capacity-auto-37": [_capacity_auto(37)],
    "two-gpu-full-1": FULL_2GPU[:1],
    "two-gpu-full-2": FULL_2GPU[1:],
    "two-gpu-engines": _two_gpu_engine_cases(8),
    "llama3-8b-auto": [LLAMA_AUTO],
    # weight offload: beside state offload, and under GPU memory caps
    "weight-offload": WEIGHT_CASES,
    "weight-offload-caps": WEIGHT_CAP_CASES[:2],
    "weight-offload-caps-proxy": WEIGHT_CAP_CASES[2:],
    "weight-offload-caps-reference": [LLAMA_UNCAPPED],
}


@dataclass
class Result:
    case: dict
    command: list[str]
    returncode: int
    status: str
    wall_s: float
    summary: dict = field(default_factory=dict)
    error_tail: str = ""
    round: int = 1  # --rounds: which pass over the suite's cases


def environment() -> dict:
    import torch

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count(),
        "commit": os.environ.get("OFFLOAD_RUNNER_COMMIT", "unknown"),
    }
    for module in ("megatron.core", "transformer_engine"):
        try:
            mod = __import__(module, fromlist=["__version__"])
            info[module] = getattr(mod, "__version__", "?")
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            info[module] = f"not importable: {type(err).__name__}"
    return info


def _rank_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("rank*.log")))


def at_hidden_fraction(case: Case, results: list[dict]) -> Case:
    """``case`` at the offload fraction its ``hidden_fraction_of`` run reported, rounded down to
    a hundredth (unchanged when that run reported none)."""
    found = next(
        (
            r["summary"].get("cpu_adam_hidden_fraction")
            for r in results
            if r["case"]["name"] == case.hidden_fraction_of
        ),
        None,
    )
    if not found:
        return case
    fraction = math.floor(found * 100) / 100
    found_fraction = f"optimizer.optimizer_offload_fraction={fraction}"
    return replace(case, overrides=(*case.overrides, found_fraction))


def run_case(case: Case, out_dir: Path, iters: int) -> Result:
    command = case.command(out_dir, iters)
    began = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - began
    run_dir = out_dir / case.slug
    summary = read_json(run_dir / SUMMARY_FILE)
    text = proc.stdout + proc.stderr
    if summary and (chose := re.search(r"^auto: (.*)$", proc.stdout, re.M)):
        summary["auto"] = chose.group(1)  # what offload/*=auto picked, and why
    recorded = read_json(run_dir / STATUS_FILE).get("status")  # what the launcher decided
    if proc.returncode == 0 and summary:
        status = "ok"
    elif recorded == "oom" or any(m in text for m in OOM_MARKERS):
        status = "OOM"
    else:
        status = f"failed ({proc.returncode})"
    return Result(
        case=asdict(case),
        command=["python", "run_recipe.py", *command[2:-2]],  # without the machine's paths
        returncode=proc.returncode,
        status=status,
        wall_s=wall,
        summary=summary,
        # the launcher's own last lines (its one-line verdict), then the ranks' logs
        error_tail="" if status == "ok" else text[-1000:] + "\n" + _rank_logs(run_dir)[-2000:],
    )


def cmd_run(args: argparse.Namespace) -> int:
    cases = SUITES[args.suite]
    if args.jobs > 1 and any(c.hidden_fraction_of for c in cases):
        sys.exit(f"--jobs: suite {args.suite} has rows that wait for an earlier row's result")
    if args.start_at:  # a later call of a suite that a time limit cut: its missing rows first
        first = next(i for i, c in enumerate(cases) if c.name == args.start_at)
        cases = cases[first:] + cases[:first]
    cases = cases[: args.count or None]
    env = environment()
    if any("cpu_adam" in " ".join(c.overrides) for c in cases):
        cores = len(os.sched_getaffinity(0))
        env["cpu_adam_reference_params_per_s"] = {
            str(n): fused_adamw_rate(n) for n in sorted({cores, max(1, cores - 2)})
        }
        print(f"torch AdamW(fused=True) alone: {env['cpu_adam_reference_params_per_s']}")
    rounds = [(n, c) for n in range(1, args.rounds + 1) for c in cases]  # A B .. A B ..
    results: list[dict] = []

    def record(result: Result) -> None:
        results.append(asdict(result))
        _print_result(result)
        saved = {"suite": args.suite, "environment": env, "iters": args.iters, "jobs": args.jobs}
        saved["results"] = results
        Path(args.out).write_text(json.dumps(saved, indent=1))

    if args.jobs > 1:
        _run_side_by_side(rounds, args, record)
    else:
        _run_in_turn(rounds, args, record, results)
    return 0


def _run_one(round_: int, case: Case, args: argparse.Namespace) -> Result:
    result = run_case(case, Path(args.work_dir) / f"round{round_}", args.iters)
    result.round = round_
    return result


def _run_in_turn(rounds, args: argparse.Namespace, record, results: list[dict]) -> None:
    """One case after another, none started that --time-limit would cut."""
    began = time.perf_counter()
    for round_, case in rounds:
        longest = max((r["wall_s"] for r in results), default=0.0)
        if args.time_limit and time.perf_counter() - began + longest > args.time_limit:
            print(f"{case.name}: not started, the next case would pass --time-limit", flush=True)
            continue
        if case.hidden_fraction_of:
            case = at_hidden_fraction(case, results)
        record(_run_one(round_, case, args))


def _run_side_by_side(rounds, args: argparse.Namespace, record) -> None:
    """--jobs cases at once on the same GPUs: for suites whose finding is the loss, not the
    time (their step times are not comparable). Results are recorded as they finish."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    with ThreadPoolExecutor(args.jobs) as pool:
        running = [pool.submit(_run_one, n, case, args) for n, case in rounds]
        for done in as_completed(running):
            record(done.result())


def _print_result(result: Result) -> None:
    s = result.summary
    print(
        f"{result.case['name']:32s} {result.status:10s} wall {result.wall_s:6.1f}s "
        f"step {s.get('step_time_s_median', float('nan')) * 1000:8.1f} ms "
        f"peak {s.get('gpu_peak_allocated_gb', float('nan')):6.2f} GB "
        f"loss {s.get('final_loss', float('nan')):.4f}",
        flush=True,
    )


# --- report -----------------------------------------------------------------------------------


def _families(files: list[Path]) -> dict[str, list[tuple[Path, dict]]]:
    """Suites split over several calls (proxy-1, proxy-2) render as one table."""
    families: dict[str, list[tuple[Path, dict]]] = {}
    for path in files:
        data = json.loads(path.read_text())
        family = re.sub(r"-\d+$", "", data["suite"])
        families.setdefault(family, []).append((path, data))
    return families


HOST_LINK_GB_PER_S = 55.0  # pinned host<->GPU copies on the benchmark host (PCIe Gen5), one way
BOTH_WAYS_GB_PER_S = 50.8  # ... each way, when both directions run at once (an H200 host)
EVIDENCE = Path(__file__).resolve().parent.parent / "docs/evidence"
H100_LINK_PROBE = EVIDENCE / "host-memory-probe-h100.txt"  # an H100 host's link, both ways


@functools.cache
def both_ways_gb_per_s(gpu: str) -> float:
    """The link each way with both directions at once, on the host of ``gpu``: an H100 host's
    from its host-memory probe (its link alone), else the H200 host's."""
    if "H100" in gpu:
        found = re.search(r"^link alone: ([\d.]+) GB/s", H100_LINK_PROBE.read_text(), re.M)
        return float(found[1])
    return BOTH_WAYS_GB_PER_S


def _states_line(r: dict, base: dict) -> str | None:
    """One state-offload run against its transfer bound and its baseline's peak. Windowed: its
    host arrays each way (10 B/param with the masters as remainders, 12 with fp32 masters; 12
    where a run did not record them), both directions at once; whole tensors: the same bytes
    out, then back."""
    s = r["summary"]
    if not (s.get("fwd_bwd_time_s_median") and base.get("fwd_bwd_time_s_median")):
        return None
    whole = is_whole_states(r)
    if whole:  # the pinned host arena is the 12 B/param moved
        moved = s["host_pinned_gb_max"] * 1024**3 / 1e9
        bound = 2 * moved / HOST_LINK_GB_PER_S * 1000
        how = f"2 x {moved:.1f} GB / {HOST_LINK_GB_PER_S:.0f} GB/s"
    else:
        moved = (
            s["states_host_gb"] * 1024**3
            if s.get("states_host_gb")
            else 12 * s["states_offloaded_params"]
        ) / 1e9
        link = rank_link_gb_per_s(
            both_ways_gb_per_s(r["environment"]["gpu"]), r["case"].get("nproc", 1)
        )
        bound = moved / link * 1000
        how = f"{moved:.1f} GB each way at once / {link:.1f} GB/s"
    overhead = (s["step_time_s_median"] - base["step_time_s_median"]) * 1000
    fwd_bwd = (s["fwd_bwd_time_s_median"] - base["fwd_bwd_time_s_median"]) * 1000
    rest = (s["optimizer_time_s_median"] - base["optimizer_time_s_median"]) * 1000
    peak = s["gpu_peak_allocated_gb"] / base["gpu_peak_allocated_gb"]
    line = (
        f"- {case_label(r)}: transfer bound {how} = {bound:.0f} ms; overhead "
        f"{overhead:.0f} ms ({overhead / bound:.2f}x the bound): forward+backward "
        f"{fwd_bwd:+.0f} ms, rest of the step {rest:+.0f} ms; peak {peak:.2f}x the "
        f"baseline's"
    )
    if not whole:
        line += (
            f"; the pass (step() to the last copy out) "
            f"{s['states_stream_s_median'] * 1000:.0f} ms, "
            f"{s['states_link_gb_per_s']:.1f} GB/s each way; window "
            f"{s['states_window_gb'] * 1024:.0f} MiB"
        )
    if s.get("states_in_backward_gb"):  # those came in before the pass: its rate counts them
        line += f", {s['states_in_backward_gb']:.1f} GB in during the last backward"
    if s.get("states_beside_forward_s") is not None:
        line += (
            f"; beside the next forward, its last Adam call "
            f"{s['states_beside_forward_s'] * 1000:.0f} ms after that forward's first "
            "wait for it"
        )
    if s.get("states_forward_wait_s_median") is not None:
        line += (
            f", that forward's thread waiting "
            f"{s['states_forward_wait_s_median'] * 1000:.0f} ms for it"
        )
    return line


def _transfer_bound_lines(results: list[dict], by_name: dict[str, dict]) -> list[str]:
    """For each optimizer-state offload case: its overhead against its transfer bound, split
    into forward+backward (whole tensors: copies out overlap it) and the rest of the step."""
    lines = []
    for r in results:
        base = _baseline(r, by_name)
        states = any(o.startswith("offload/optimizer=states") for o in r["case"]["overrides"])
        if states and r["status"] == "ok" and (line := _states_line(r, base)):
            lines.append(line)
    if lines:
        lines = [
            "",
            "Optimizer-state offload against the transfer bound (vs this suite's "
            "baseline; phases timed with CUDA events):",
            "",
            *lines,
        ]
    return lines


def _weight_offload_lines(results: list[dict], by_name: dict[str, dict]) -> list[str]:
    """For each weight-offload case: its overhead against its baseline beside the link bound
    (step_cost.weight_offload_link_bytes: both directions at once at planner.host_link_gb_per_s)."""
    from offload_runner.config.compose import compose_config, to_run_config
    from offload_runner.plan import grad_bytes
    from offload_runner.step_cost import (
        weight_offload_link_bytes,
        weight_offload_sum_bytes,
        weight_offload_update_bytes,
    )

    lines = []
    for r in results:
        s = r["summary"]
        base = _baseline(r, by_name)
        if r["status"] != "ok" or not s.get("weight_offload_params") or not base:
            continue
        run = to_run_config(
            compose_config([f"recipe={r['case']['recipe']}", *r["case"]["overrides"]])
        )
        up, down = weight_offload_link_bytes(run, s["weight_offload_params"])
        bound = max(up, down) / (run.planner.host_link_gb_per_s * 1e9)
        overhead = s["step_time_s_median"] - base["step_time_s_median"]
        sums = weight_offload_sum_bytes(run, s["weight_offload_params"])
        least = max(up - sums, down) / (run.planner.host_link_gb_per_s * 1e9)
        lines.append(
            f"- {case_label(r)}: {s['weight_offload_params'] / 1e9:.2f}B params on "
            f"the host, {up / 1e9:.1f} GB up and {down / 1e9:.1f} GB down per step: link "
            f"bound {_ms(bound)} ms ({_ms(least)} ms without the gradients' sums coming "
            f"back up); overhead {_ms(overhead)} ms ({overhead / bound:.2f}x the bound, "
            f"{overhead / least:.2f}x the one without the sums)"
        )
        held = s["weight_offload_params"] * (2 + grad_bytes(run)) / 1024**3  # bf16 + DDP's grads
        drop = base["gpu_peak_allocated_gb"] - s["gpu_peak_allocated_gb"]
        lines.append(
            f"  - GPU peak {base['gpu_peak_allocated_gb']:.2f} -> "
            f"{s['gpu_peak_allocated_gb']:.2f} GB: {drop:.2f} GB less, {drop / held:.3f}x "
            f"the offloaded layers' weights and gradients ({held:.2f} GB)"
        )
        if "weight_offload_up_gb" in s:  # what the engine counted, less the update's
            update, _ = weight_offload_update_bytes(run, s["weight_offload_params"])
            moved = s["weight_offload_up_gb"] * 1e9 - update
            ahead = moved / (run.planner.host_link_gb_per_s * 1e9)
            extra = s["fwd_bwd_time_s_median"] - base["fwd_bwd_time_s_median"]
            lines.append(
                f"  - forward+backward alone: {moved / 1e9:.1f} GB up (weights, the "
                f"gradients' sums; counted by the engine): {_ms(ahead)} ms at the link; "
                f"forward+backward {_ms(extra)} ms over the baseline's "
                f"({extra / ahead:.2f}x)"
            )
    if lines:
        lines = [
            "",
            "Weight offload against its link bound (all it moves, the offloaded "
            "params' states included, which the baseline's state offload moves too; vs "
            "the same run with its weights on the GPU):",
            "",
            *lines,
        ]
    return lines


def _baseline(r: dict, by_name: dict) -> dict:
    """The summary of ``r``'s baseline run: of its own call where render found one."""
    return (r.get("base") or by_name.get(r["case"]["baseline"], {})).get("summary", {})


def _of_call(r: dict, name: str, results: list[dict], by_name: dict) -> dict:
    """Case ``name``'s run from ``r``'s own call where it ran there, else the family's."""
    mine = [o for o in results if o["source"] == r["source"] and o["case"]["name"] == name]
    return mine[0] if mine else by_name.get(name, {})


def case_label(r: dict) -> str:
    """The case name; state-offload runs that moved whole tensors under the old meaning of
    offload/optimizer=states say so."""
    name = r["case"]["name"]
    name += r.get("call", "")  # which call, where a family's calls share a case
    if is_whole_states(r) and "whole" not in name:
        return f"{name} [whole tensors]"
    return name


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def _delayed_experts_bound(name: str, s: dict, base_step: float, rated: str, ref: float | None):
    """The routed experts one step late, the dense part exact (with its GPU share) first:
    max(baseline step, the experts' CPU Adam) + the dense part's exact update."""
    offloaded, rate, late = (
        s["cpu_offloaded_params"],
        s["cpu_adam_params_per_s"],
        s.get("cpu_adam_delayed_params") or 0,
    )
    on_gpu, gpu_rate = s.get("cpu_adam_params_on_gpu"), s.get("cpu_adam_stream_params_per_s")
    now = offloaded - late
    exact_s = now / (rate + gpu_rate) if on_gpu and gpu_rate else now / rate
    bound = max(base_step, late / rate) + exact_s
    gpu = (
        f" and on {on_gpu / 1e9:.2f}B of the dense part's on the GPU, their states "
        f"through the window at {gpu_rate / 1e9:.2f} G/s"
        if on_gpu and gpu_rate
        else ""
    )
    return bound, [
        f"- {name}: the states of {offloaded / 1e9:.2f}B params on the host, {late / 1e9:.2f}B "
        f"(the routed experts) updated one step late and {now / 1e9:.2f}B (the dense part) "
        f"exactly; Adam on the CPU at {rated}{gpu}",
        f"bound max({_ms(base_step)}, {_ms(late / rate)}) + the exact part {_ms(exact_s)} = "
        f"{_ms(bound)} ms, step {_ms(s['step_time_s_median'])} ms = "
        f"{s['step_time_s_median'] / bound:.2f}x the bound",
    ]


def _gpu_share_bound(name: str, s: dict, base_step: float, rated: str, ref: float | None):
    """Exact mode with a GPU share: the CPU and the window at once, baseline step + offloaded /
    (both rates); beside it the CPU's alone at its rate, and the whole update's rate (its
    params over the longer of the CPU worker and the window's pass) against fused AdamW."""
    offloaded, rate = s["cpu_offloaded_params"], s["cpu_adam_params_per_s"]
    gpu_rate = s["cpu_adam_stream_params_per_s"]
    step, both = s["step_time_s_median"], offloaded / (rate + gpu_rate)
    cpu_alone = base_step + offloaded / rate
    return base_step + both, [
        f"- {name}: the states of {offloaded / 1e9:.2f}B params on the host; "
        + _split(s, rated, "states")
        + f" ({12 * gpu_rate / 1e9:.1f} GB/s each way)",
        f"bound at both rates sum({_ms(base_step)}, {_ms(both)}) = {_ms(base_step + both)} ms, "
        f"step {_ms(step)} ms = {step / (base_step + both):.2f}x that bound and "
        f"{step / cpu_alone:.2f}x the CPU's alone at its rate, sum({_ms(base_step)}, "
        f"{_ms(offloaded / rate)}) = {_ms(cpu_alone)} ms",
        _whole_update(s, ref),
    ]


def _split(s: dict, rated: str, what: str) -> str:
    """Where a GPU share run's Adam ran: the CPU's params at ``rated``, the GPU's share and the
    rate ``what`` (its states, with or without gradients) came through the window at."""
    return (
        f"Adam on {s['cpu_adam_params_on_cpu'] / 1e9:.2f}B on the CPU at {rated} and on "
        f"{s['cpu_adam_params_on_gpu'] / 1e9:.2f}B (a GPU share of "
        f"{s['cpu_adam_gpu_share']:.2f}) on the GPU, their {what} through the window at "
        f"{s['cpu_adam_stream_params_per_s'] / 1e9:.2f} G/s"
    )


def _whole_update(s: dict, ref: float | None) -> str:
    """A GPU share run's update as a whole (the longer of the CPU worker and the window's
    pass) against torch's fused AdamW alone on every offloaded param."""
    update_s = max(s["cpu_adam_wall_s_median"], s["cpu_adam_stream_s_median"])
    whole = s["cpu_offloaded_params"] / update_s
    return f"the whole update {_ms(update_s)} ms = {whole / 1e9:.2f} G params/s" + (
        f", {whole / ref:.2f}x torch's fused AdamW alone" if ref else ""
    )


def _late_share_bound(name: str, s: dict, base_step: float, rated: str, ref: float | None):
    """Delayed mode with a GPU share: the CPU and the window at once under the next
    forward+backward, max(baseline step, offloaded / (both rates)); beside it the CPU's alone."""
    offloaded, rate = s["cpu_offloaded_params"], s["cpu_adam_params_per_s"]
    step = s["step_time_s_median"]
    both = offloaded / (rate + s["cpu_adam_stream_params_per_s"])
    bound = max(base_step, both)
    return bound, [
        f"- {name}: {offloaded / 1e9:.2f}B params updated one step late; "
        + _split(s, rated, "states and gradients"),
        f"bound max({_ms(base_step)}, {_ms(both)}) = {_ms(bound)} ms, step {_ms(step)} ms = "
        f"{step / bound:.2f}x the bound",
        _whole_update(s, ref),
    ]


def _cpu_bound(name: str, s: dict, base_step: float, rated: str, ref: float | None):
    """Every offloaded param's Adam on the CPU: exact, baseline step + CPU Adam; delayed, the
    larger of the two."""
    cpu = s["cpu_offloaded_params"] / s["cpu_adam_params_per_s"]
    delayed = s.get("cpu_adam_mode") == "delayed"
    bound, step = (max if delayed else sum)((base_step, cpu)), s["step_time_s_median"]
    return bound, [
        f"- {name}: {s['cpu_offloaded_params'] / 1e9:.2f}B params on the CPU at {rated}",
        f"bound {'max' if delayed else 'sum'}({_ms(base_step)}, {_ms(cpu)}) = {_ms(bound)} ms, "
        f"step {_ms(step)} ms = {step / bound:.2f}x the bound",
    ]


def _cpu_adam_lines(results: list[dict], by_name: dict[str, dict]) -> list[str]:
    """Each CPU-Adam run against its bound (``_*_bound`` per mode), its rate against torch's
    fused AdamW alone, where the rest of its time goes, and its speed-up over
    HybridDeviceOptimizer 100% of the same batch."""
    lines = []
    for r in results:
        reference = r["environment"].get("cpu_adam_reference_params_per_s", {})
        s = r["summary"]
        if r["status"] != "ok" or not s.get("cpu_adam_params_per_s"):
            continue
        base = _baseline(r, by_name)
        base_step = base.get("step_time_s_median")
        if not base_step or base.get("cpu_adam_params_per_s"):  # no bound without a no-offload run
            continue
        rate, step = s["cpu_adam_params_per_s"], s["step_time_s_median"]
        delayed = s.get("cpu_adam_mode") in ("delayed", "delayed experts")
        ref = reference.get(str(s.get("cpu_adam_threads")))
        hdo_name = r["case"]["baseline"].replace("no offload", "HDO 100% + overlap")
        hdo = _of_call(r, hdo_name, results, by_name).get("summary", {}).get("step_time_s_median")
        hdo = hdo if hdo_name != r["case"]["baseline"] else None
        rated = f"{rate / 1e9:.2f} G/s ({s['cpu_adam_threads']} threads" + (
            f"; {rate / ref:.2f}x torch's fused AdamW alone, {ref / 1e9:.2f} G/s)" if ref else ")"
        )
        if s.get("cpu_adam_mode") == "delayed experts":
            bounded = _delayed_experts_bound
        elif s.get("cpu_adam_params_on_gpu") and s.get("cpu_adam_stream_params_per_s"):
            bounded = _late_share_bound if delayed else _gpu_share_bound
        else:
            bounded = _cpu_bound
        _, parts = bounded(case_label(r), s, base_step, rated, ref)
        parts.append(
            f"CPU worker {_ms(s['cpu_adam_wall_s_median'])} ms (Adam "
            f"{_ms(s['cpu_adam_busy_s_median'])}, waiting for gradients "
            f"{_ms(s['cpu_adam_wait_s_median'])})"
            + (
                f", the window's pass {_ms(s['cpu_adam_stream_s_median'])} ms"
                if s.get("cpu_adam_params_on_gpu")
                else ""
            )
            + (
                f" (the states of {s['cpu_adam_in_backward_params'] / 1e9:.2f}B params in "
                "during the last backward)"
                if s.get("cpu_adam_in_backward_params")
                else ""
            )
        )
        if s.get("cpu_adam_lands_in_forward") and not delayed:
            waited = s.get("cpu_adam_forward_wait_s_median")
            parts.append(
                "landing during the next forward"
                + (f" (which waited {_ms(waited)} ms for it)" if waited is not None else "")
            )
        if delayed and "cpu_adam_copies_in_backward" in s:
            parts.append(
                (
                    "copies during the last backward"
                    if s["cpu_adam_copies_in_backward"]
                    else "copies at the step boundary"
                )
                + f" (step() {_ms(s['cpu_adam_boundary_s_median'])} ms until "
                "the update was handed over)"
            )
        if hdo and r["case"]["name"] != hdo_name:
            parts.append(f"{hdo / step:.2f}x faster than HDO 100% + overlap")
        lines.append("; ".join(parts))
    if lines:
        lines = [
            "",
            "CPU-Adam engine against its bounds (this suite's baseline; CPU rate from "
            "the engine's own timing of its Adam calls):",
            "",
            *lines,
        ]
    return lines


def tail_mean(losses: list[float], n: int = CONVERGENCE_TAIL) -> float:
    return statistics.fmean(losses[-n:])


def convergence(results: list[dict]) -> dict | None:
    """Runs named ``... seed N``: each configuration's final loss (the mean of the last
    CONVERGENCE_TAIL iterations) per seed, set against the baseline's spread across seeds.
    ``within_noise``: every configuration's mean over seeds is within that spread of the
    baseline's mean."""
    finals: dict[str, dict[int, float]] = {}
    baseline = None
    for r in results:
        match = re.fullmatch(r"(.*) seed (\d+)", r["case"]["name"])
        if not match or r["status"] != "ok":
            continue
        finals.setdefault(match[1], {})[int(match[2])] = tail_mean(r["summary"]["losses"])
        if r["case"]["name"] == r["case"]["baseline"]:
            baseline = match[1]
    if baseline is None or len(finals.get(baseline, {})) < 2:
        return None
    base = finals[baseline]
    spread = max(base.values()) - min(base.values())
    rows = {}
    for name, by_seed in finals.items():
        if name == baseline:
            continue
        gap = statistics.fmean(by_seed.values()) - statistics.fmean(base.values())
        paired = {seed: v - base[seed] for seed, v in by_seed.items() if seed in base}
        rows[name] = {
            "final": by_seed,
            "gap": gap,
            "paired": paired,
            "within_noise": abs(gap) <= spread,
        }
    return {"baseline": baseline, "baseline_final": base, "spread": spread, "runs": rows}


def _convergence_lines(results: list[dict]) -> list[str]:
    found = convergence(results)
    if found is None:
        return []
    base = found["baseline_final"]
    lines = [
        "",
        f"Final loss (mean of the last {CONVERGENCE_TAIL} iterations) per seed; the "
        f"baseline ({found['baseline']}) spreads {found['spread']:.3f} across seeds "
        f"({', '.join(f'{s}: {v:.3f}' for s, v in base.items())}):",
        "",
    ]
    for name, row in found["runs"].items():
        finals = ", ".join(f"{s}: {v:.3f}" for s, v in row["final"].items())
        paired = ", ".join(f"{s}: {d:+.3f}" for s, d in row["paired"].items())
        verdict = "within" if row["within_noise"] else "outside"
        lines.append(
            f"- {name}: {finals}; against the same seed's baseline {paired}; mean "
            f"{row['gap']:+.3f} against the baseline's, {verdict} its spread"
        )
    return lines


def _scale_lines(results: list[dict]) -> list[str]:
    """Multi-GPU runs: the planner's verdict and prediction beside time to first step, every
    rank's GPU peak and the node's RAM (the run's own, over what the node used before)."""
    rows = []
    for r in results:
        if not any(arg.startswith("planner.gpu_memory_gb=") for arg in r["command"]):
            continue  # planned for the machine it names, as --plan would be
        plan, s = plan_of(r), r["summary"]
        ranks = [rank.gpu_peak / 2**30 for rank in plan.ranks]
        planned_host = plan.max_node_host_gb
        verdict = "fits" if plan.limiting is None else f"does not fit ({plan.limiting})"
        measured = s.get("gpu_peak_per_rank_gb")
        before, peak = s.get("host_used_gb_before_per_node"), s.get("host_used_gb_max_per_node")
        startup = s.get("startup_s") or {}
        rows.append(
            [
                case_label(r),
                verdict,
                r["status"],
                fmt(s.get("time_to_first_step_s"), ".0f")
                + (
                    f" ({', '.join(f'{k} {v:.0f}' for k, v in startup.items())})" if startup else ""
                ),
                f"{min(measured):.1f}-{max(measured):.1f}" if measured else "-",
                f"{min(ranks):.1f}-{max(ranks):.1f}",
                fmt(max(p - b for p, b in zip(peak, before, strict=True)), ".1f") if peak else "-",
                f"{planned_host:.1f}",
            ]
        )
    if not rows:
        return []
    return [
        "",
        "Per rank and per node, beside `--plan` on the same command line:",
        "",
        *markdown_table(
            [
                "config",
                "--plan",
                "status",
                "time to first step s (phases s)",
                "GPU peak per rank GB",
                "planned GB",
                "node RAM used by the run GB",
                "planned host GB",
            ],
            rows,
        ),
    ]


# The headline: per offload mode and batch, its latest suite's row against that suite's
# baseline (suite, case); the suite tables below hold everything else.
HEADLINE = [
    # throughput: today's line (MB 1, Megatron-Core's kernels), the fused kernels at MB 4, auto
    ("throughput-16", "MB1 plain"),
    ("throughput-16", "MB4 fused"),
    ("throughput-16", "auto"),
    # the 37-layer slice on one H200: today's line against auto (micro-batch included)
    ("throughput-37", "today"),
    ("throughput-37", "auto"),
    # the CPU-Adam engine's modes with the fused kernels
    *[
        (f"engines-{gbs}", f"GBS{gbs} {name}")
        for gbs in (4, 8)
        for name in ("cpu_adam", "cpu_adam_delayed", "cpu_adam bf16 moments")
    ],
    ("weight-offload", "dense 8 layers, states + weights of 8"),
    ("weight-offload", "proxy, states + weights of 4"),
    ("weight-offload-caps", "llama3_8b under 48 GB, weights of 31 layers"),
    ("weight-offload-caps-proxy", "proxy under 12 GB, weights of 4 layers"),
    ("capacity-auto-28", "28 layers, no offload"),
    ("capacity-auto-28", "28 layers, auto"),
    ("capacity-auto-31", "31 layers, auto"),
    ("capacity-auto-37", "37 layers, auto"),
    ("whole-model", "whole model, no offload"),
    ("whole-model", "whole model auto"),
    ("two-gpu-full-1", "full EP2 no offload"),
    ("two-gpu-full-2", "full EP2 auto"),
    ("two-gpu-engines", "proxy DP2 GBS8 cpu_adam"),
    ("two-gpu-engines", "proxy DP2 GBS8 states"),
    ("two-gpu-engines", "proxy EP2 GBS8 cpu_adam"),
    ("two-gpu-engines-2", "proxy EP2 GBS8 states"),
    ("cpu-adam-split-1", "GBS1 cpu_adam 100%"),
    # exact offload's cost at each batch: the latest suites (one H100)
    *[
        (f"gbs-{gbs}-beside", f"cost GBS{gbs} {name}")
        for gbs in (4, 8, 32)
        for name in ("cpu_adam 100%", "states", "HDO 100% + overlap", "cpu_adam_delayed 100%")
    ],
    ("llama3-8b-auto", "llama3_8b seq 8192 GBS 8, auto"),
    ("bf16-moments", "states, bf16 moments"),
    ("bf16-moments", "cpu_adam, bf16 moments"),
]


# Suites run in interleaved rounds over several calls: the headline takes each row's medians.
INTERLEAVED = {"throughput-16", "throughput-37", "engines-4", "engines-8", "mb8-states"}
MEDIAN_KEYS = (
    "step_time_s_median",
    "fwd_bwd_time_s_median",
    "tokens_per_s_median",
    "tflops_per_gpu_median",
    "gpu_peak_allocated_gb",
)


def _medians(calls: list[dict], key: tuple[str, str]) -> dict:
    """A row's summary with MEDIAN_KEYS as medians over every call's ok run of it."""
    runs = [
        r["summary"]
        for d in calls
        if d["suite"] == key[0]
        for r in d["results"]
        if r["case"]["name"] == key[1] and r["status"] == "ok"
    ]
    return {**runs[-1], **{k: statistics.median(s[k] for s in runs) for k in MEDIAN_KEYS}}


def _gpu_label(call: dict, result: dict) -> str:
    """The GPU a run used, and how many where more than one ("H200 x2")."""
    n = result["case"].get("nproc", 1)
    return call["environment"]["gpu"].replace("NVIDIA ", "") + (f" x{n}" if n > 1 else "")


def _headline(files: list[Path]) -> list[str]:
    """The HEADLINE rows found among ``files``: what each offload mode costs, as measured."""
    calls = sorted(
        (json.loads(p.read_text()) for p in files), key=lambda d: d["environment"]["date"]
    )
    found = {(d["suite"], r["case"]["name"]): (r, d) for d in calls for r in d["results"]}  # latest
    rows = []
    for key in HEADLINE:
        if key not in found:
            continue
        r, d = found[key]
        s = r["summary"]
        base = next(
            (
                b["summary"]
                for b in d["results"]
                if b["case"]["name"] == r["case"]["baseline"] != r["case"]["name"]
            ),
            {},
        )
        if key[0] in INTERLEAVED:  # the medians over the suite's calls, its rounds
            s = _medians(calls, key)
            base = _medians(calls, (key[0], r["case"]["baseline"])) if base else {}
        step = s.get("step_time_s_median")
        fb, base_fb = s.get("fwd_bwd_time_s_median"), base.get("fwd_bwd_time_s_median")
        rows.append(
            [
                r["case"]["name"],
                f"`{key[0]}` {d['environment']['commit'][:7]}",
                _gpu_label(d, r),
                r["status"],
                fmt(step * 1000 if step else None, ".0f"),
                fmt(ratio(step, base.get("step_time_s_median")), ".2f", "x"),
                fmt(ratio(fb, base_fb), ".2f", "x"),
                fmt(s.get("tokens_per_s_median"), ",.0f"),
                fmt(s.get("tflops_per_gpu_median"), ".0f"),
                fmt(s.get("gpu_peak_allocated_gb")),
                fmt(s.get("host_used_gb_max_per_node", [None])[0]),
            ]
        )
    if not rows:
        return []
    return [
        "## Headline",
        "",
        "What each offload mode costs, from its latest suite (ratios against that suite's own",
        "baseline on the same machine: its no-offload run, or for weight offload the same run",
        "with its weights on the GPU; the proxy at micro-batch 1 is launch-bound, so a suite's",
        "baseline wanders with the host: compare within a suite). Rows of suites run in",
        f"interleaved rounds ({', '.join(f'`{x}`' for x in sorted(INTERLEAVED))}) are medians over "
        "their calls.",
        "",
        *markdown_table(
            [
                "run",
                "suite, commit",
                "GPU",
                "status",
                "step ms",
                "step vs baseline",
                "fwd+bwd vs baseline",
                "tokens/s",
                "TFLOP/s/GPU",
                "GPU peak GB",
                "host RAM GB",
            ],
            rows,
        ),
        "",
    ]


REPORTS = ROOT / "docs/benchmarks"


def _reports() -> list[str]:
    """A line per topic report in docs/benchmarks/ (its title)."""
    found = sorted(REPORTS.glob("*.md"))
    lines = [
        f"- [{p.read_text().splitlines()[0].lstrip('# ')}](benchmarks/{p.name})" for p in found
    ]
    return ["## Reports", "", *lines, ""] if lines else []


def render(files: list[Path], suite: str | None = None) -> str:
    """docs/BENCHMARKS.md: the reports, the headline and a line per suite; with ``suite``, that
    suite's runs in full instead (their tables, bounds, commands and loss curves)."""
    families = _families(files)
    if suite is not None:
        return "\n".join(_suite_section(suite, families[suite]))
    lines = [
        "# Benchmarks",
        "",
        "Real training runs, recorded by `bench/run_benchmarks.py` in `bench/results/` and read",
        "here (never edited by hand). Step time is the median over iterations 3..N; peak GPU",
        "memory is `torch.cuda.max_memory_allocated()`; GB are GiB.",
        "",
        "    python bench/run_benchmarks.py run --suite SUITE --out results-SUITE.json   # GPU",
        "    python bench/run_benchmarks.py report bench/results/*.json > docs/BENCHMARKS.md",
        "    python bench/run_benchmarks.py report --suite SUITE bench/results/*.json  # its runs",
        "",
        *_reports(),
        *_headline(files),
        *_suite_index(families),
    ]
    return "\n".join(lines)


def _suite_index(families: dict[str, list[tuple[Path, dict]]]) -> list[str]:
    """A row per suite whose findings no report holds: its calls, GPU, rows and dates (its runs
    in full: ``report --suite``)."""
    rows = []
    for suite, group in sorted(families.items()):
        if all(d["suite"] in IN_REPORTS for _, d in group):
            continue
        gpus = sorted({_gpu_label(d, r) for _, d in group for r in d["results"]})
        dates = sorted(d["environment"]["date"][:10] for _, d in group)
        cases = {r["case"]["name"] for _, d in group for r in d["results"]}
        span = dates[0] if dates[0] == dates[-1] else f"{dates[0]}..{dates[-1][5:]}"
        rows.append([f"`{suite}`", str(len(group)), ", ".join(gpus), str(len(cases)), span])
    head = ["suite", "calls", "GPU", "rows", "dates"]
    return ["## Every other suite", "", *markdown_table(head, rows), ""] if rows else []


# Suites whose findings live in a topic report of docs/benchmarks (once, there):
# bench/throughput.py's, convergence.py's, capacity.py's, weight_offload.py's, gbs_report.py's,
# gpu_tests.py's.
CAPACITY = {"capacity-28", "capacity-auto-28", "capacity-auto-31", "capacity-auto-37"}
GBS_CALLS = ("", "-beside", "-grown", "-pairs", "-pairs-2", "-pairs-3", "-pairs-4")
OPTIMIZER_OFFLOAD = {  # gbs_report.py's
    "beside-4-ab",
    "exact-4-ab",
    *(f"remainders-{n}" for n in (4, 8, 32)),
    *(f"gbs-{n}{call}" for n in (4, 8, 32) for call in GBS_CALLS),
}
IN_REPORTS = {
    *OPTIMIZER_OFFLOAD,
    *throughput.SUITES,
    "convergence",
    "convergence-ep2",
    *CAPACITY,
    "whole-model",
    "full-4gpu",
    "two-gpu-full-1",
    "two-gpu-full-2",
    "weight-offload",
    "weight-offload-caps",
    "weight-offload-caps-proxy",
    "weight-offload-caps-reference",
}


def _suite_section(suite: str, group: list[tuple[Path, dict]]) -> list[str]:
    """One suite family's section: the machine of each call, its rows' table, the lines set
    against bounds, the commands and the loss curves."""
    results = [
        {**r, "environment": d["environment"], "source": path.name}
        for path, d in group
        for r in d["results"]
    ]
    by_name = {r["case"]["name"]: r for r in results}
    names = [r["case"]["name"] for r in results]
    for r in results:  # the baseline of its own call where it has one, else the family's
        r["base"] = _of_call(r, r["case"]["baseline"], results, by_name)
        if len(set(names)) < len(names):  # calls share a case: each row says its call
            r["call"] = f" ({r['source'].removeprefix('results-').removesuffix('.json')})"
    iters = sorted({d["iters"] for _, d in group})
    lines = [f"## Suite `{suite}` ({' / '.join(map(str, iters))} iterations)", ""]
    for path, d in group:  # a family's files may come from different calls or machines
        e = d["environment"]
        lines += [
            f"GPU: {e['gpu']} x{e['gpu_count']} · torch {e['torch']} (CUDA {e['cuda']}) · "
            f"megatron-core {e['megatron.core']} · transformer-engine "
            f"{e['transformer_engine']} · Python {e['python']} · {e['date']} · "
            f"commit {e['commit']} · {d['iters']} iterations · "
            f"{', '.join(r['case']['name'] for r in d['results'])} · source `{path.name}`",
            "",
        ]
    lines += markdown_table(
        [
            "config",
            "status",
            "step ms (fwd+bwd / rest)",
            "slowdown",
            "peak GPU GB",
            "saved GB",
            "peak fwd+bwd / step GB",
            "pinned host GB",
            "final loss",
            "max abs Δloss vs baseline",
        ],
        [_row(r, by_name) for r in results],
    )
    lines += _transfer_bound_lines(results, by_name)
    lines += _weight_offload_lines(results, by_name)
    lines += _cpu_adam_lines(results, by_name)
    lines += _scale_lines(results)
    lines += _convergence_lines(results)
    lines += [
        f"- {r['case']['name']}: auto chose {r['summary']['auto']}"
        for r in results
        if r["summary"].get("auto")
    ]
    lines += ["", "Commands:", ""]
    lines += [f"- {case_label(r)}: `{' '.join(r['command'])}`" for r in results]
    lines += _loss_curves(results)
    for r in results:
        if r["status"] != "ok":
            lines += [
                "",
                f"`{r['case']['name']}` ended:",
                "",
                "```",
                failure_lines(r["error_tail"]),
                "```",
            ]
    return [*lines, ""]


def _row(r: dict, by_name: dict) -> list[str]:
    """A run's row of its suite's table, against its baseline."""
    s = r["summary"]
    base = _baseline(r, by_name)
    step, peak = s.get("step_time_s_median"), s.get("gpu_peak_allocated_gb")
    same = r["case"]["name"] == r["case"]["baseline"]
    phases = (
        f" ({s['fwd_bwd_time_s_median'] * 1000:.0f} / {s['optimizer_time_s_median'] * 1000:.0f})"
        if s.get("fwd_bwd_time_s_median")
        else ""
    )
    delta = max_abs_delta(s.get("losses", []), base.get("losses", []))
    return [
        case_label(r),
        r["status"],
        fmt(step * 1000 if step else None, ".1f") + phases,
        fmt(ratio(step, base.get("step_time_s_median")), ".2f", "x"),
        fmt(peak),
        fmt(None if same else saved(peak, base.get("gpu_peak_allocated_gb")), "+.2f"),
        f"{s['gpu_peak_fwd_bwd_gb']:.2f} / {s['gpu_peak_step_gb']:.2f}"
        if s.get("gpu_peak_step_gb")
        else "-",
        fmt(s.get("host_pinned_gb_max")),
        fmt(s.get("final_loss"), ".4f"),
        "(baseline)" if same else fmt(delta, ".2e"),
    ]


def _loss_curves(results: list[dict]) -> list[str]:
    """Every run's per-iteration loss, a column each, folded away."""
    losses = {case_label(r): r["summary"].get("losses", []) for r in results}
    longest = max((len(v) for v in losses.values()), default=0)
    if not longest:
        return []
    curves = [
        [f"{v[i]:.4f}" if i < len(v) else "" for v in losses.values()] for i in range(longest)
    ]
    return [
        "",
        "<details><summary>loss curves</summary>",
        "",
        *markdown_table(["iter", *losses], [[str(i + 1), *row] for i, row in enumerate(curves)]),
        "",
        "</details>",
    ]


def failure_lines(tail: str) -> str:
    """What the user saw of a failed run (our error and fix lines) and the rank log's exception
    line; the whole tail where neither is there."""
    lines = tail.splitlines()
    said = [line for line in lines if line.startswith(("error:", "  fix:"))]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return "\n".join([*said, *raised[-1:]]) if said else tail[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one suite on this GPU machine")
    run.add_argument("--suite", choices=sorted(SUITES), required=True)
    run.add_argument("--out", required=True, help="result JSON file")
    run.add_argument("--work-dir", default="bench-runs", help="where the run directories go")
    run.add_argument("--iters", type=int, default=ITERS)
    run.add_argument("--rounds", type=int, default=1, help="passes over the cases, interleaved")
    run.add_argument("--start-at", help="the case to start with (the rest follow in turn)")
    run.add_argument("--count", type=int, default=0, help="run this many cases (0: all)")
    run.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cases at once (suites that measure loss, not time; no --time-limit then)",
    )
    run.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: start no case that would end past this (the longest so far)",
    )
    report = sub.add_parser("report", help="Markdown from result files")
    report.add_argument("files", nargs="+", type=Path)
    report.add_argument("--suite", help="one suite's runs in full (its tables and commands)")
    args = parser.parse_args()
    if args.command == "run":
        return cmd_run(args)
    families = _families(args.files)
    if args.suite is not None and args.suite not in families:
        known = ", ".join(sorted(families))
        print(f"error: no results of suite {args.suite!r}; one of: {known}", file=sys.stderr)
        return 2
    print(render(args.files, args.suite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
