#!/usr/bin/env python
"""The benchmark suites as data: each a list of Cases (a recipe, its overrides, its baseline),
run by bench/run_benchmarks.py on a GPU machine."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


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

    def command(self, run_dir: Path, iters: int, extra: tuple[str, ...] = ()) -> list[str]:
        return [
            sys.executable,
            str(ROOT / "run_recipe.py"),
            "--recipe",
            self.recipe,
            *self.overrides,
            *extra,
            f"train.train_iters={iters}",
            f"output_dir={run_dir}",
            f"launcher.nproc_per_node={self.nproc}",
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


# Issue 70: the chunked loss beside Transformer Engine's fused cross entropy on whole logits,
# deterministic, MB 4 (16k tokens a micro-batch: 7.3 GB of bf16 logits): losses and peaks.
MB4_DETERMINISTIC = ("train.global_batch_size=8", "train.micro_batch_size=4", DETERMINISTIC[-1])
CHUNKED_LOSS = [
    Case(name, PROXY_RECIPE, (*MB4_DETERMINISTIC, *extra), "whole logits")
    for name, extra in (("whole logits", ()), ("chunked loss", ("model.chunked_loss=true",)))
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


COLUMNS = ("offload/optimizer=cpu_adam_delayed", "optimizer.cpu_adam_exact_columns=0.1")
# Issue 72: delayed updates with exact columns against exact training on real text over 2,000
# iterations (GBS 16 x 512: two epochs of the 8.2M-token training split), two seeds each, beside
# plain delayed updates; side by side (--jobs 5), 500 iterations a call on one warm machine
# (--segment 500). Their step: suite columns-8 (--rounds 3).
LONG_TEXT = (*REAL_TEXT[:-1], "validation.eval_interval=100")
CONVERGENCE_LONG = [
    Case(name, CONVERGENCE_RECIPE, (*LONG_TEXT, *extra), "reference")
    for name, extra in (
        ("reference", ()),
        ("reference seed 2", ("rng.seed=1235",)),
        ("cpu_adam_delayed columns", COLUMNS),
        ("cpu_adam_delayed columns seed 2", (*COLUMNS, "rng.seed=1235")),
        ("cpu_adam_delayed", ("offload/optimizer=cpu_adam_delayed",)),
    )
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
# Issue 70: the whole model at GBS 16 on one H200 (pass needs_h200): today's line against auto's
# pick (one pair a call, the order swapped in the next: --start-at auto), and the planner's
# peak at each micro-batch under full recompute (--iters 3; MB 8's logits in chunks).
WHOLE_16 = ("parallel=single", "train.global_batch_size=16", "scheduler.lr_warmup_iters=2")
WHOLE_16 += ("planner.gpu_memory_gb=139", "planner.host_memory_gb=125", "offload/optimizer=auto")
WHOLE_MODEL_FAST = [
    Case(name, "qwen3_30b_a3b", (*WHOLE_16, f"train.micro_batch_size={mb}"), "today")
    for name, mb in (("today", 1), ("auto", "auto"))
]
WHOLE_MODEL_MB = [
    Case(
        f"MB {mb}",
        "qwen3_30b_a3b",
        (*WHOLE_16, *FULL_RECOMPUTE, f"train.micro_batch_size={mb}", *extra),
        "MB 1",
    )
    for mb, extra in ((8, ("model.chunked_loss=true",)), (4, ()), (2, ()), (1, ()))
]


# The suites a session may run again (earlier suites' results stay in bench/results and render
# as they ran: the report needs no definition of them).
SUITES: dict[str, list[Case]] = {
    # issue 55: kernels, micro-batch and auto; the 37-layer slice; the CPU-Adam engine's modes
    "throughput-16": _throughput_cases(),
    "throughput-37": THROUGHPUT_37,
    "convergence": _convergence_cases(),
    "convergence-ep2": CONVERGENCE_EP2,
    "convergence-long": CONVERGENCE_LONG,
    "columns-8": [c for c in _engine_cases(8) if "bf16" not in c.name]
    + [Case("GBS8 delayed columns", PROXY_RECIPE, (*_batch(8), *COLUMNS, *DELAY), "GBS8 cpu_adam")],
    "whole-model-fast": WHOLE_MODEL_FAST,
    "whole-model-mb": WHOLE_MODEL_MB,
    "chunked-loss": CHUNKED_LOSS,
    **{f"engines-{gbs}": _engine_cases(gbs) for gbs in (4, 8)},
    # exact offload's cost against the batch (no offload, both exact engines, HDO, delayed)
    **{f"gbs-{gbs}": _cost_cases(gbs) for gbs in (4, 8, 32)},
    "cpu-adam-4": _cpu_adam_cases(4),
    "bf16-moments": _bf16_moment_cases(),
    "determinism": _determinism_cases(),
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
