"""The GPU step-time model (gpu_time.py) against suite throughput-16, and auto choosing the
micro-batch (train.micro_batch_size=auto)."""

from __future__ import annotations

import statistics
import sys

import pytest
from conftest import PROJECT_ROOT, compose_run

from offload_runner.auto import choose_offload
from offload_runner.cli import EXIT_OK, main
from offload_runner.gpu_time import forward_backward_seconds
from offload_runner.hardware import GPU_ADAM_S_PER_PARAM, GPU_RATES

sys.path.insert(0, str(PROJECT_ROOT / "bench"))
import throughput  # noqa: E402

FILES = sorted((PROJECT_ROOT / "bench/results").glob("results-throughput-16-r*.json"))
PROXY_16 = (
    "recipe=qwen3_30b_a3b_proxy",
    "train.global_batch_size=16",
    "train.gpu_memory_cap_gb=79",
    "planner.host_memory_gb=125",
    "planner.cpu_adam_params_per_s=4e9",
)


@pytest.fixture(scope="module")
def rows() -> list[throughput.Row]:
    return throughput.load(FILES)[0]


def test_the_rates_are_the_fit_of_the_suite(rows) -> None:
    """hardware.GPU_RATES and GPU_ADAM_S_PER_PARAM are what `bench/throughput.py fit` gives
    from the committed results (rounded to three figures)."""
    fitted_on = {f"results-throughput-16-r{n}.json" for n in (1, 2, 3)}  # later calls test it
    found = throughput.fit(rows, fitted_on)
    for kernels, rates in found["rates"].items():
        assert GPU_RATES[kernels].flops == pytest.approx(rates["flops"], rel=0.01)
        assert GPU_RATES[kernels].expert_s == pytest.approx(rates["expert_s"], rel=0.01)
    assert found["gpu_adam_s_per_param"] == pytest.approx(GPU_ADAM_S_PER_PARAM, rel=0.01)


def test_the_model_prices_held_out_rows_within_15_percent_at_each_calls_rates(rows) -> None:
    """Held out of the fit: MB 2, full recompute at MB 4, state offload at MB 8 (its stream, then
    the window's Adam) and auto's own run, each against the model at the rates its call's
    fitted rows give (the median over its calls)."""
    by = {r.name: r for r in rows}
    for name in ("MB2 fused", "MB4 fused full recompute", "MB8 fused states", "auto"):
        found = by[name].call_errors()
        assert found, name
        assert abs(throughput.median_error(found)) < throughput.TOLERANCE, name


def test_a_calls_rates_are_refit_on_that_calls_fitted_rows_alone(rows) -> None:
    """A call that ran MB 1 and MB 4 fused refits the fused rates on those two runs: the
    model then gives both of its fitted rows' forward+backward exactly."""
    by = {r.name: r for r in rows}
    source = "results-throughput-16-r6.json"
    gpu = by["MB4 fused"].call_rates[source]
    for name in ("MB1 fused", "MB4 fused"):
        ran = statistics.median(by[name].values("fwd_bwd_time_s_median", {source}))
        assert forward_backward_seconds(by[name].run, gpu=gpu) == pytest.approx(ran, rel=1e-6)
    assert "plain" not in throughput.fit(rows, {source})["rates"]  # no plain rows there


def test_a_small_micro_batch_is_launch_bound_and_fusions_speed_the_matrix_work() -> None:
    """At MB 1 the proxy's fixed time (128 experts x 4 layers x 16 micro-batches) is most of
    forward+backward; MB 4 cuts it by four; the fused kernels shorten only the FLOP part."""
    mb1 = forward_backward_seconds(compose_run(*PROXY_16, "train.micro_batch_size=1"))
    mb4 = forward_backward_seconds(compose_run(*PROXY_16, "train.micro_batch_size=4"))
    plain4 = forward_backward_seconds(
        compose_run(*PROXY_16, "train.micro_batch_size=4", "speed=plain")
    )
    fixed = 16 * 4 * (GPU_RATES["fused"].dense_layer_s + 128 * GPU_RATES["fused"].expert_s)
    assert mb1 - mb4 == pytest.approx(fixed * 3 / 4)
    assert plain4 / mb4 > 1.2


def test_a_ratio_is_over_the_calls_that_ran_both_rows_and_said_inside_or_outside() -> None:
    """A call on a faster host (c) does not move the ratio of rows it did not run both of."""

    def row(name: str, **steps: float) -> throughput.Row:
        runs = [
            {"status": "ok", "source": call, "summary": {"step_time_s_median": s}}
            for call, s in steps.items()
        ]
        return throughput.Row(name, runs)

    rows = [row("fast", a=1.0, b=1.2, c=0.5), row("slow", a=2.0, b=2.2)]
    assert throughput.comparisons(rows, [("fast", "slow", "it")]) == [
        "- it: 1.91x tokens/s, 0.52x the step (outside it)"
    ]


def test_each_call_that_ran_both_rows_twice_gets_its_own_ratio() -> None:
    """Calls of a suite may run other code: each that ran both rows twice (interleaved) says
    its own ratio and commit beside the pooled one; a call with one run of a row says none."""

    def runs(call: str, commit: str, *steps: float) -> list[dict]:
        env = {"commit": commit}
        summary = [{"step_time_s_median": s} for s in steps]
        return [{"status": "ok", "source": call, "environment": env, "summary": x} for x in summary]

    fast = throughput.Row(
        "fast",
        [
            *runs("results-s-r1.json", "aaaaaaa1", 1.0, 1.1),
            *runs("results-s-r2.json", "bbbbbbb2", 0.8, 0.9),
            *runs("results-s-r3.json", "ccccccc3", 0.1),
        ],
    )
    slow = throughput.Row(
        "slow",
        [
            *runs("results-s-r1.json", "aaaaaaa1", 1.0, 1.2),
            *runs("results-s-r2.json", "bbbbbbb2", 1.0, 1.1),
            *runs("results-s-r3.json", "ccccccc3", 1.0),
        ],
    )
    (line,) = throughput.comparisons([fast, slow], [("fast", "slow", "it")])
    assert line.endswith(
        "; by call: r1 (aaaaaaa) 0.95x (inside the spread), r2 (bbbbbbb) 0.81x (outside it)"
    )
    assert throughput.inside_spread([1.0, 1.2], [1.1, 1.5])
    assert not throughput.inside_spread([1.0, 1.05], [1.1, 1.5])


def test_auto_picks_the_micro_batch_with_the_most_predicted_tokens_per_s() -> None:
    """The suite's auto row: MB 4 without offload (measured the fastest row there); it names the
    next two settings with their predicted tokens/s."""
    run = compose_run(*PROXY_16, "planner.auto_micro_batch=true", "offload/optimizer=auto")
    choice = choose_offload(run)
    assert choice.overrides["train.micro_batch_size"] == 4
    assert choice.overrides["model.recompute_granularity"] is None
    assert choice.overrides["optimizer.optimizer_cpu_offload"] is False
    assert choice.description.startswith("train.micro_batch_size=4, offload/optimizer=disabled")
    _, _, following = choice.description.partition("; next: ")
    assert following.count("tokens/s") == 2


def test_auto_turns_to_recompute_where_a_larger_micro_batch_needs_it() -> None:
    """Under 64 GB MB 4 fits only with full recompute or offload: auto weighs both."""
    run = compose_run(*PROXY_16, "train.gpu_memory_cap_gb=64", "planner.auto_micro_batch=true")
    choice = choose_offload(run)
    assert choice.plan.limiting is None
    mb = choice.overrides["train.micro_batch_size"]
    assert mb > 1 and choice.overrides["model.recompute_granularity"] is not None


def test_micro_batch_auto_on_the_command_line(tmp_path, capsys) -> None:
    """train.micro_batch_size=auto is a spelling of planner.auto_micro_batch=true: --dry-run
    says what auto picked."""
    args = [
        "--recipe",
        "qwen3_30b_a3b_proxy",
        "train.global_batch_size=16",
        "train.micro_batch_size=auto",
        "planner.gpu_memory_gb=79",
        "planner.host_memory_gb=125",
        f"output_dir={tmp_path}/run",
        "--dry-run",
    ]
    assert main(args) == EXIT_OK
    out = capsys.readouterr().out
    assert "auto: train.micro_batch_size=4" in out.replace("\n", " ")


def test_auto_offers_no_recompute_beside_layer_offload(tmp_path) -> None:
    """With offload/activation=enabled auto chose MB 4 with full recompute, which validation
    then refused (Megatron-Core: no recompute with CPU offloading)."""
    args = [
        "--recipe",
        "qwen3_30b_a3b_proxy",
        "train.global_batch_size=16",
        "planner.gpu_memory_gb=60",
        "planner.host_memory_gb=125",
        "train.micro_batch_size=auto",
        "offload/activation=enabled",
        "model.cpu_offloading_num_layers=3",
        f"output_dir={tmp_path}/run",
        "--dry-run",
    ]
    assert main(args) == EXIT_OK
    run = compose_run(*PROXY_16, "planner.auto_micro_batch=true", "offload/activation=enabled")
    assert choose_offload(run).overrides["model.recompute_granularity"] is None


def test_delayed_cpu_adam_hides_under_the_predicted_forward_backward() -> None:
    """Without planner.forward_backward_s, delayed mode's CPU Adam hides under gpu_time's
    forward+backward (suite engines-4: the model had it all exposed, 2.76 s against runs of
    1.21 and 1.33 s); a measured planner.forward_backward_s still wins."""
    from offload_runner.plan import make_plan
    from offload_runner.step_cost import step_cost

    args = (*PROXY_16, "offload/optimizer=cpu_adam_delayed", "train.micro_batch_size=1")
    run = compose_run(*args)
    cost = step_cost(run)
    assert cost.forward_backward_s == pytest.approx(forward_backward_seconds(run))
    rank = make_plan(run).ranks[0]
    exposed = rank.delayed_params / cost.delayed_rate(run)
    assert cost.delayed_seconds(run, rank) < 0.5 * exposed
    assert "delayed: hidden under forward+backward" in cost.explain(run, rank)
    measured = step_cost(compose_run(*args, "planner.forward_backward_s=0.5"))
    assert measured.forward_backward_s == 0.5


def test_the_throughput_report_is_what_the_results_make(tmp_path) -> None:
    """docs/benchmarks/throughput.md is bench/throughput.py's report of the committed results
    (its figures held: change a result or the text and this fails)."""
    made = throughput.render(sorted((PROJECT_ROOT / "bench/results").glob("*.json")), tmp_path)
    assert (PROJECT_ROOT / "docs/benchmarks/throughput.md").read_text().rstrip() == made.rstrip()
