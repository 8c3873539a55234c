"""The memory planner's arithmetic on configs small enough to work out by hand, auto, the CLI,
and its error against the measured peaks in bench/results (the calibration)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from offload_runner.auto import choose_offload
from offload_runner.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from offload_runner.hardware import cpu_adam_piece_bytes
from offload_runner.model_size import count_parameters, largest_modules
from offload_runner.plan import (
    CHECKPOINTED_COPIES,
    HOST_PROCESS_BYTES,
    REBUILT_COPIES,
    WORKSPACE_BYTES,
    Layout,
    layer_activations,
    layer_params,
    make_plan,
    minimal_world_size,
    rebuilt_bytes,
)
from tests.conftest import compose_run

ROOT = Path(__file__).resolve().parents[1]
P_TINY = count_parameters(compose_run("recipe=tiny").model).total  # 5,245,440


TINY_LAYER = 11264  # bytes per token one tiny layer keeps (test_tiny_without_offload)
TINY_MODEL_LEVEL = 4 * 2 * 256  # embedding out, final norm in and out, output layer in
TINY_ACTIVATIONS = (4 * TINY_LAYER + TINY_MODEL_LEVEL) * 512


def test_recompute_keeps_layer_inputs_and_rebuilds_one_group() -> None:
    base_run = compose_run("recipe=tiny")
    base = make_plan(base_run).ranks[0]
    full_run = compose_run(
        "recipe=tiny",
        "model.recompute_granularity=full",
        "model.recompute_method=uniform",
        "model.recompute_num_layers=2",
    )
    full = make_plan(full_run).ranks[0]
    hidden = 2 * 256 * 512
    # two groups keep CHECKPOINTED_COPIES of their inputs' size; then the model level
    assert full.activations == 2 * CHECKPOINTED_COPIES * hidden + 4 * hidden
    # backward rebuilds one group of 2 layers, and holds their gradients beside them
    assert full.recomputed == REBUILT_COPIES * 2 * TINY_LAYER * 512
    assert full.fwd_bwd_peak == full.static + full.activations + max(full.logits, full.recomputed)
    assert rebuilt_bytes(full_run) == full.recomputed and rebuilt_bytes(base_run) == 0
    block = make_plan(
        compose_run(
            "recipe=tiny",
            "model.recompute_granularity=full",
            "model.recompute_method=block",
            "model.recompute_num_layers=1",
        )
    ).ranks[0]
    assert block.activations == (hidden + 3 * TINY_LAYER * 512) + 4 * hidden
    # selective (core attention): flash attention keeps no score matrix, nothing to save
    selective = make_plan(compose_run("recipe=tiny", "model.recompute_granularity=selective"))
    assert selective.ranks[0].gpu_peak == base.gpu_peak


def test_tiny_parameter_count_by_hand() -> None:
    # embedding + output 2 x 4096 x 256; per layer: qkv 256 x (256 + 2*128), proj 256 x 256,
    # q/k norms 2 x 32, MLP 256 x 768 x 2 + 768 x 256, two norms 2 x 256; final norm 256
    per_layer = 256 * 512 + 256 * 256 + 64 + 256 * 768 * 3 + 512
    assert 2 * 4096 * 256 + 4 * per_layer + 256 == P_TINY


def test_tiny_without_offload() -> None:
    rank = make_plan(compose_run("recipe=tiny", "planner.gpu_memory_gb=80")).ranks[0]
    assert (rank.weights, rank.grads, rank.optimizer_gpu) == (2 * P_TINY, 4 * P_TINY, 12 * P_TINY)
    assert rank.optimizer_step_only == rank.host_pinned == rank.host_pageable == 0
    # per layer and token (h 256, q 256, kv 128, f 768): QKV out 2 x 512, attention out 2 x 256,
    # rotary Q and K 2 x 384, QK norms 2 x 384; two norms' inputs and outputs 8h; GLU MLP fc1
    # out 4f, silu(x) 2f, fc2 input 2f
    layer = layer_activations(compose_run("recipe=tiny"))
    assert layer.per_rank(tp=1, sequence_parallel=False) == 3072 + 2048 + 6144
    # one micro-batch of 2 x 256 tokens in flight, 4 layers + 4 hidden-sized model-level copies;
    # logits 6 B x vocab per token
    assert rank.activations == TINY_ACTIVATIONS
    assert rank.logits == 6 * 4096 * 512
    assert rank.gpu_peak == 18 * P_TINY + WORKSPACE_BYTES + TINY_ACTIVATIONS + 6 * 4096 * 512


def test_hybrid_optimizer_moves_its_fraction_to_the_host() -> None:
    rank = make_plan(compose_run("recipe=tiny", "offload/optimizer=cpu_50")).ranks[0]
    assert rank.optimizer_gpu == 6 * P_TINY
    assert rank.host_pageable == 6 * P_TINY  # CPU Adam: master + 2 states for half the params
    assert rank.host_pinned == 3 * P_TINY  # pinned grad + param copies, 6 B for half


def test_state_offload_moves_the_optimizer_to_the_step_phase() -> None:
    """Every master (its 16-bit remainder) and moment on the host, 10 B/param; the step holds a
    window of them (tiny's whole shard fits one)."""
    rank = make_plan(compose_run("recipe=tiny", "offload/optimizer=states")).ranks[0]
    assert rank.optimizer_gpu == 0 and rank.optimizer_step_only == 10 * P_TINY
    assert rank.host_pinned == 10 * P_TINY == rank.states_moved
    assert rank.step_peak == 16 * P_TINY + WORKSPACE_BYTES
    fp32 = compose_run(
        "recipe=tiny", "offload/optimizer=states", "optimizer.store_param_remainders=false"
    )
    assert make_plan(fp32).ranks[0].host_pinned == 12 * P_TINY
    assert rank.fwd_bwd_peak == 6 * P_TINY + WORKSPACE_BYTES + rank.activations + rank.logits


def test_distributed_optimizer_shards_over_data_parallel_ranks() -> None:
    run = compose_run("recipe=tiny")
    plan = make_plan(run, world=4, gpus_per_node=2)
    assert [r.optimizer_gpu for r in plan.ranks] == [12 * P_TINY // 4] * 4
    assert [r.node for r in plan.ranks] == [0, 0, 1, 1]
    # gbs 4 / (mbs 2 x DP 4) rounds up to one micro-batch per rank: same activations
    assert plan.ranks[0].activations == TINY_ACTIVATIONS


def test_experts_split_over_ep_and_shard_over_expert_data_parallel() -> None:
    run = compose_run("recipe=tiny_moe", "parallel=ep2")
    layout = Layout.of(run, 4)
    assert (layout.dp, layout.edp) == (4, 2)
    counts = count_parameters(run.model)
    rank = make_plan(run, world=4).ranks[0]
    experts_per_rank = counts.experts // 2
    assert rank.weights == 2 * (counts.non_expert + experts_per_rank)
    assert rank.optimizer_gpu == int(12 * (counts.non_expert / 4 + experts_per_rank / 2))


def test_pipeline_stages_hold_their_layers_and_in_flight_micro_batches() -> None:
    run = compose_run(
        "recipe=tiny", "model.pipeline_model_parallel_size=2", "train.global_batch_size=8"
    )
    plan = make_plan(run, world=2)
    first, last = plan.ranks
    stage = (2 * TINY_LAYER + TINY_MODEL_LEVEL) * 512  # 2 layers each
    assert first.activations == 2 * stage  # 2 micro-batches in flight (1F1B)
    assert last.activations == 1 * stage
    assert first.logits == 0 and last.logits == 6 * 4096 * 512


def test_activation_offload_takes_layers_off_the_peak() -> None:
    base = make_plan(compose_run("recipe=tiny")).ranks[0]
    off = make_plan(
        compose_run(
            "recipe=tiny", "offload/activation=enabled", "model.cpu_offloading_num_layers=2"
        )
    ).ranks[0]
    assert 0 < off.activations_offloaded < 2 * TINY_LAYER * 512
    assert off.activations == base.activations - off.activations_offloaded


def test_weight_offload_takes_its_layers_weights_gradients_and_states_off_the_gpu() -> None:
    """Two of tiny's four layers: their bf16 weights and fp32 gradients leave DDP's buffers (the
    ring comes instead: bf16 weights of its two widest modules side by side and one fp32
    gradient slot of the widest), their optimizer state leaves the states engine, and the host
    holds weights, gradients, masters and moments."""
    states = ("recipe=tiny", "offload/optimizer=states")
    base = make_plan(compose_run(*states)).ranks[0]
    run = compose_run(*states, "offload/weight=enabled", "model.cpu_offloading_num_layers=2")
    off = make_plan(run).ranks[0]
    counts = count_parameters(run.model)
    layer = (P_TINY - counts.embedding) / 4  # tiny's norms: every layer's and the final one
    widest, second = largest_modules(run.model)[:2]
    assert widest + second < layer
    ring = 2 * (widest + second) + 4 * widest
    assert off.weights == pytest.approx(base.weights - 2 * 2 * layer + ring, abs=64)
    assert off.grads == pytest.approx(base.grads - 2 * 4 * layer, abs=64)
    assert off.states_moved == pytest.approx(base.states_moved - 2 * 10 * layer, abs=64)
    extra = off.host_pinned - base.host_pinned + (base.states_moved - off.states_moved)
    assert extra == pytest.approx(2 * layer * (2 + 4 + 4 + 8), abs=64)


def test_the_largest_module_is_the_dense_mlps_fc1_or_all_experts_fc1() -> None:
    """llama3_8b: fc1 (gate and up, 4096 x 2 x 14336); the proxy: its 128 experts' fc1
    together (2048 x 2 x 768 each), a third of a MoE layer's weights less than the whole."""
    llama = compose_run("recipe=llama3_8b").model
    assert largest_modules(llama)[0] == 4096 * 2 * 14336
    proxy = compose_run("recipe=qwen3_30b_a3b_proxy").model
    assert largest_modules(proxy)[0] == 128 * 2048 * 2 * 768
    assert largest_modules(proxy)[0] < 0.7 * sum(layer_params(proxy))


def test_the_link_note_counts_activation_offload_beside_weight_offload() -> None:
    """Both on one link: the weights' bytes and the activations' (what activation offload takes
    off the GPU per micro-batch, down and up again) in one bound; activations alone say so."""
    from offload_runner.step_cost import weight_offload_link_bytes, weight_offload_note

    both = compose_run(
        "recipe=llama3_8b",
        "train.global_batch_size=8",
        "offload/optimizer=states",
        "offload/weight=enabled",
        "offload/activation=enabled",
        "model.cpu_offloading_num_layers=8",
    )
    plan = make_plan(both)
    rank = plan.ranks[0]
    up, down = weight_offload_link_bytes(both, rank.weight_offload_params)
    activations = 8 * rank.activations_offloaded  # eight micro-batches
    note = weight_offload_note(both, plan)
    assert f"activation offload {activations / 1e9:.3g} GB each way" in note
    assert f"+{(max(up, down) + activations) / 50.8e9:.2f} s" in note
    alone = compose_run(
        "recipe=llama3_8b", "offload/activation=enabled", "model.cpu_offloading_num_layers=8"
    )
    assert weight_offload_note(alone, make_plan(alone)).startswith("activation offload moves")
    plain = compose_run("recipe=tiny")
    assert weight_offload_note(plain, make_plan(plain)) is None


def test_auto_turns_to_weight_offload_only_where_nothing_else_fits() -> None:
    """The proxy held to 12 GB: no optimizer setting fits, with full recompute neither, state
    offload with weight offload of the fewest layers does, and the choice says what the weights
    cost on the link."""
    capped = (
        "recipe=qwen3_30b_a3b_proxy",
        "train.global_batch_size=4",
        "planner.host_memory_gb=125",
        "offload/optimizer=auto",
    )
    choice = choose_offload(compose_run(*capped, "train.gpu_memory_cap_gb=12"))
    assert choice.overrides["model.cpu_offloading_weights"] is True
    assert choice.overrides["optimizer.offload_optimizer_states"] is True
    assert "weight offload of" in choice.description and "GB up" in choice.description
    roomy = choose_offload(compose_run(*capped, "train.gpu_memory_cap_gb=80"))
    assert not roomy.overrides.get("model.cpu_offloading_weights")


def test_a_gpu_memory_cap_is_the_planners_gpu() -> None:
    plan = make_plan(compose_run("recipe=tiny", "train.gpu_memory_cap_gb=24"))
    assert (plan.gpu_capacity_gb, plan.gpu_capacity_source) == (24.0, "train.gpu_memory_cap_gb")
    # both set: the smaller, since the run enforces the cap whatever the planner is told
    both = ("recipe=tiny", "train.gpu_memory_cap_gb=24", "planner.gpu_memory_gb=40")
    assert make_plan(compose_run(*both)).gpu_capacity_gb == 24.0
    smaller = make_plan(compose_run(*both[:2], "planner.gpu_memory_gb=20"))
    assert (smaller.gpu_capacity_gb, smaller.gpu_capacity_source) == (20.0, "planner.gpu_memory_gb")


def test_minimal_world_of_the_full_recipe() -> None:
    assert minimal_world_size(compose_run("recipe=qwen3_30b_a3b")) == 8  # TP4 x PP2, EP4 x PP2


def test_auto_picks_the_least_optimizer_offload_that_fits() -> None:
    """At an H200 host's CPU Adam rate (4 G params/s; the rate is measured on this machine
    otherwise), half of Adam on the CPU (0.39 s) beats streaming the states (0.73 s)."""
    run = compose_run(
        "recipe=qwen3_30b_a3b_proxy",
        "train.global_batch_size=4",
        "offload/optimizer=auto",
        "planner.gpu_memory_gb=48",
        "planner.host_memory_gb=512",
        "planner.cpu_adam_params_per_s=4e9",
    )
    choice = choose_offload(run)
    assert choice.overrides["optimizer.optimizer_offload_fraction"] == 0.5
    assert choice.overrides["optimizer.cpu_offload_engine"].value == "cpu_adam"
    assert "offload/optimizer=cpu_adam optimizer.optimizer_offload_fraction=0.5" in (
        choice.description
    )
    hybrid = compose_run(
        "recipe=qwen3_30b_a3b_proxy",
        "train.global_batch_size=4",
        "offload/optimizer=auto",
        "planner.auto_engine=hybrid",
        "planner.gpu_memory_gb=48",
        "planner.host_memory_gb=512",
        "planner.cpu_adam_params_per_s=4e9",
    )
    slow = choose_offload(hybrid).description  # HDO's CPU Adam at 0.27x: streaming wins
    assert slow.startswith("offload/optimizer=states") and "; next: states" in slow
    assert "cpu_50" not in slow.partition("; next: ")[2]  # HDO ranks below two state settings


def test_cpu_adam_pieces_are_64_mib_or_a_sixteenth_of_a_small_part() -> None:
    """The engine's piece (no key): 64 MiB for the proxy's parts; a part too small for 16 of
    them (tiny's 5.2M params: 21 MB) takes the largest power-of-two MiB that makes 16."""
    assert cpu_adam_piece_bytes(3.1e9) == 64 * 1024**2
    assert cpu_adam_piece_bytes(64 * 1024**2 / 4 * 16) == 64 * 1024**2
    assert cpu_adam_piece_bytes(64 * 1024**2 / 4 * 16 - 1) == 32 * 1024**2
    assert cpu_adam_piece_bytes(P_TINY) == 1024**2  # 5.2M x 4 B / 16 = 1.25 MiB
    assert P_TINY * 4 / cpu_adam_piece_bytes(P_TINY) >= 16
    assert cpu_adam_piece_bytes(1000) == 1024**2  # at least 1 MiB


def test_cpu_adam_engine_host_memory() -> None:
    """16 B per offloaded param on the host (8 pinned), against HDO's 18 (6 pinned); on the GPU
    the engine keeps its ring of two pieces of fp32 masters (1 MiB pieces for the tiny model,
    64 MiB for the proxy's parts)."""
    engine = make_plan(
        compose_run("recipe=tiny", "offload/optimizer=cpu_adam", "optimizer.cpu_adam_gpu_share=0")
    ).ranks[0]
    hdo = make_plan(compose_run("recipe=tiny", "offload/optimizer=cpu_100")).ranks[0]
    params = count_parameters(compose_run("recipe=tiny").model).total
    assert engine.host_pinned == pytest.approx(8 * params, rel=1e-6)
    assert engine.host - HOST_PROCESS_BYTES == pytest.approx(16 * params, rel=1e-6)
    assert engine.optimizer_step_only == 0
    assert hdo.host - HOST_PROCESS_BYTES == pytest.approx(18 * params, rel=1e-6)
    assert hdo.optimizer_gpu == 0
    assert engine.optimizer_gpu == 2 * 1024**2
    proxy = compose_run("recipe=qwen3_30b_a3b_proxy", "offload/optimizer=cpu_adam")
    assert make_plan(proxy).ranks[0].optimizer_gpu == 2 * 2 * 64 * 1024**2  # dense, experts
    # with the GPU share (the default): the moments pinned too, and the step holds a window of
    # up to 4 pieces of masters and moments per part
    shared = make_plan(compose_run("recipe=tiny", "offload/optimizer=cpu_adam")).ranks[0]
    assert shared.host_pinned == pytest.approx(16 * params, rel=1e-6)
    assert shared.host == shared.host_pinned + HOST_PROCESS_BYTES
    assert shared.optimizer_step_only == 4 * 12 * 1024**2 // 4
    assert make_plan(proxy).ranks[0].optimizer_step_only == 2 * 4 * 3 * 64 * 1024**2


def test_auto_tries_activation_layers_before_the_optimizer() -> None:
    run = compose_run(
        "recipe=qwen3_30b_a3b_proxy",
        "train.global_batch_size=4",
        "offload/optimizer=auto",
        "offload/activation=auto",
        "planner.host_memory_gb=512",
    )
    base = make_plan(run).worst.gpu_peak / 1024**3
    run.planner.gpu_memory_gb = base + 2.0 - 0.2  # just short: one offloaded layer is enough
    choice = choose_offload(run)
    assert choice.overrides["model.cpu_offloading_num_layers"] == 1
    assert choice.overrides["optimizer.optimizer_cpu_offload"] is False


def test_auto_refuses_when_nothing_fits() -> None:
    run = compose_run(
        "recipe=qwen3_30b_a3b_proxy",
        "offload/optimizer=auto",
        "planner.gpu_memory_gb=10",
        "planner.host_memory_gb=512",
    )
    with pytest.raises(ValueError, match="no offload setting fits"):
        choose_offload(run)


def test_auto_skips_options_that_exhaust_host_ram() -> None:
    """16 GB of host RAM: nothing in fp32 fits beside the GPU's 48 GB, so auto gives up
    precision (bf16 moments) and says so; 8 GB: nothing fits at all."""
    common = (
        "recipe=qwen3_30b_a3b_proxy",
        "train.global_batch_size=4",
        "offload/optimizer=auto",
        "planner.gpu_memory_gb=48",
        "planner.cpu_adam_params_per_s=4e9",
    )
    choice = choose_offload(compose_run(*common, "planner.host_memory_gb=16"))
    assert "bf16 moments (validation loss +0.19% on real text" in choice.description
    assert "nothing in the configured precision fits" in choice.description
    assert choice.overrides["optimizer.exp_avg_dtype"].value == "bf16"
    assert choice.plan.max_node_host_gb + choice.plan.margin_gb <= 16
    with pytest.raises(ValueError, match="host RAM"):
        choose_offload(compose_run(*common, "planner.host_memory_gb=8"))


def test_auto_finds_what_trains_28_layers_on_one_h200_box() -> None:
    """Qwen3-30B-A3B's first 28 layers on 139 GB of GPU and 125 GB of host RAM (suite
    capacity-28 trained a setting like it, with bf16 gradients too): state offload of part of
    the states with bf16 moments (the masters' remainders, 2 B/param on the host, spare the
    gradients' precision), the process and the margin counted on the host."""
    run = compose_run(
        "recipe=qwen3_30b_a3b",
        "parallel=single",
        "model.num_layers=28",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "offload/optimizer=auto",
        "planner.gpu_memory_gb=139",
        "planner.host_memory_gb=125",
    )
    choice = choose_offload(run)
    assert choice.overrides["optimizer.offload_optimizer_states"] is True
    assert "ddp.grad_reduce_in_fp32" not in choice.overrides
    assert 0.5 <= choice.overrides["optimizer.optimizer_state_offload_fraction"] < 1.0
    assert choice.plan.limiting is None


def test_plan_json_has_gpu_and_host_per_rank(capsys) -> None:
    code = main(
        [
            "--recipe",
            "tiny",
            "launcher.nproc_per_node=2",
            "--plan",
            "--json",
            "planner.gpu_memory_gb=80",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK and data["fits"] and data["world_size"] == 2
    assert [set(r) >= {"gpu_peak_gb", "host_gb"} for r in data["ranks"]] == [True, True]


def test_plan_table_and_verdict(capsys) -> None:
    assert (
        main(
            [
                "--recipe",
                "qwen3_30b_a3b_proxy",
                "--plan",
                "planner.gpu_memory_gb=40",
                "planner.host_memory_gb=512",
            ]
        )
        == EXIT_FAILED
    )
    out = capsys.readouterr().out
    assert "GPU peak" in out and "does not fit" in out and "GPU memory runs out first" in out


def test_plan_with_auto_prints_its_choice(capsys) -> None:
    assert (
        main(
            [
                "--recipe",
                "qwen3_30b_a3b_proxy",
                "train.global_batch_size=4",
                "--plan",
                "offload/optimizer=auto",
                "planner.gpu_memory_gb=48",
                "planner.host_memory_gb=512",
                "planner.cpu_adam_params_per_s=4e9",
            ]
        )
        == EXIT_OK
    )
    assert "auto: offload/optimizer=cpu_adam optimizer.optimizer_offload_fraction=0.5" in (
        capsys.readouterr().out
    )


def test_auto_that_cannot_fit_exits_2(capsys) -> None:
    assert (
        main(
            [
                "--recipe",
                "qwen3_30b_a3b_proxy",
                "--plan",
                "offload/optimizer=auto",
                "planner.gpu_memory_gb=10",
            ]
        )
        == EXIT_USAGE
    )
    assert "no offload setting fits" in capsys.readouterr().err


def test_json_without_plan_is_a_usage_error(capsys) -> None:
    assert main(["--recipe", "tiny", "--json"]) == EXIT_USAGE
    assert "--json goes with --plan" in capsys.readouterr().err


def test_planner_matches_every_measured_peak_within_10_percent() -> None:
    """The calibration: every GPU run recorded in bench/results, planned from its command."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from calibrate_planner import calibrate, render_report

    rows = calibrate(sorted((ROOT / "bench" / "results").glob("*.json")))
    assert len(rows) >= 20
    worst = max(rows, key=lambda r: abs(r.error))
    assert abs(worst.error) < 0.10, f"{worst.suite}/{worst.case}: {worst.error:+.1%}"
    report = render_report(rows, 0.1, plot=None)  # docs/benchmarks/planner.md: a line a suite
    assert all(f"| {suite} |" in report for suite in {r.suite for r in rows if r.measured_gb > 1})
    # the spread (dense and MoE, micro-batch 1-4, sequence 2k-32k, recompute, every optimizer
    # offload mode, four GPUs): the runs the activation model was not read from, within 10%
    held_out = [r for r in rows if r.held_out and r.suite.startswith(("spread", "full-4gpu"))]
    assert len(held_out) >= 7
    assert max(abs(r.error) for r in held_out) < 0.10
    # state offload: both phases and its page-locked host memory (the states, 12 B/param)
    states = [r for r in rows if "states offload" in r.case]
    assert len(states) >= 6
    for r in states:
        for measured, planned in (
            (r.measured_fwd_bwd_gb, r.planned_fwd_bwd_gb),
            (r.measured_step_gb, r.planned_step_gb),
            (r.measured_pinned_gb, r.planned_pinned_gb),
        ):
            assert abs(planned - measured) < 0.10 * measured, f"{r.suite}/{r.case}"


WHOLE_16 = (
    "recipe=qwen3_30b_a3b",
    "parallel=single",
    "train.global_batch_size=16",
    "planner.gpu_memory_gb=139",
    "planner.host_memory_gb=125",
)


def test_the_whole_model_plans_within_3_percent_at_every_micro_batch() -> None:
    """Suite whole-model-mb (one H200, full recompute, MB 1/2/4/8, MB 8 with the chunked loss)
    and auto's MB 8 of whole-model-fast: the planned peak within 3% of the measured one, from
    the run's own command and from what the run wrote beside it (summary.json)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from calibrate_planner import calibrate

    files = sorted((ROOT / "bench" / "results").glob("results-whole-model-*.json"))
    rows = [r for r in calibrate(files) if r.suite.startswith("whole-model-")]
    assert {r.case for r in rows} >= {"MB 1", "MB 2", "MB 4", "MB 8", "auto"}
    for r in rows:
        assert abs(r.error) < 0.03, f"{r.suite}/{r.case}: {r.error:+.1%}"
    # the run's own planned peak beside its measured one (the MB rows ran before the refit)
    auto = json.loads((ROOT / "bench/results/results-whole-model-fast-auto-r2.json").read_text())
    summary = auto["results"][0]["summary"]
    assert abs(summary["planned_gpu_peak_gb"] / summary["gpu_peak_allocated_gb"] - 1) < 0.03


def test_auto_takes_the_chunked_loss_where_whole_logits_do_not_fit() -> None:
    """The whole model at GBS 16 on one H200: MB 8 with whole logits runs out of memory (it did,
    twice: Transformer Engine's cross entropy asked 9.27 GB more at 131.9 GB), with the logits
    in chunks it fits, and it is auto's pick."""
    recompute = ("model.recompute_granularity=full", "model.recompute_num_layers=1")
    q8 = ("offload/optimizer=states", "optimizer.exp_avg_dtype=q8", "optimizer.exp_avg_sq_dtype=q8")
    mb8 = (*WHOLE_16, *recompute, *q8, "ddp.grad_reduce_in_fp32=false", "train.micro_batch_size=8")
    assert make_plan(compose_run(*mb8)).limiting == "gpu"
    assert make_plan(compose_run(*mb8, "model.chunked_loss=true")).limiting is None
    choice = choose_offload(
        compose_run(*WHOLE_16, "planner.auto_micro_batch=true", "offload/optimizer=auto")
    )
    assert choice.overrides["train.micro_batch_size"] == 8
    assert choice.overrides["model.chunked_loss"] is True
    assert "chunked loss" in choice.description


def test_context_parallel_halves_each_ranks_sequence_and_shards_over_dp_x_cp() -> None:
    one = make_plan(compose_run("recipe=tiny"), world=1).ranks[0]
    cp2 = make_plan(compose_run("recipe=tiny", "parallel=cp2"), world=2).ranks[0]
    assert (cp2.activations, cp2.logits) == (one.activations // 2, one.logits // 2)
    assert cp2.optimizer_gpu == one.optimizer_gpu // 2 and cp2.weights == one.weights


def test_auto_weighs_state_offload_against_cpu_adam_by_predicted_step_time() -> None:
    """On PCIe CPU Adam beside its balanced GPU share costs less per param than streaming all
    10 B of states each way; on a link several times faster (Grace-Hopper class) the balanced
    share streams most states itself, so CPU Adam and state offload price within a few percent:
    both run the streamed states' Adam in the GPU window after they land."""
    common = (
        "recipe=qwen3_30b_a3b_proxy",
        "speed=plain",
        "train.global_batch_size=4",
        "offload/optimizer=auto",
        "planner.gpu_memory_gb=60",
        "planner.host_memory_gb=512",
        "planner.cpu_adam_params_per_s=4e9",
    )
    pcie = choose_offload(compose_run(*common, "planner.host_link_gb_per_s=50.8"))
    assert pcie.overrides["optimizer.offload_optimizer_states"] is False
    assert pcie.overrides["optimizer.optimizer_offload_fraction"] == 0.25
    assert "predicted +0.16 s per step" in pcie.description
    assert "cpu_adam optimizer.optimizer_offload_fraction=0.5 +0.31 s" in pcie.description
    assert "Adam on 46% of them on the CPU" in pcie.description  # the balanced GPU share
    c2c = choose_offload(compose_run(*common, "planner.host_link_gb_per_s=450"))
    assert "Adam on 12% of them on the CPU" in c2c.description
    assert "states optimizer.optimizer_state_offload_fraction=0.5 +0.07 s" in c2c.description
    hybrid = choose_offload(
        compose_run(*common, "planner.host_link_gb_per_s=450", "planner.auto_engine=hybrid")
    )
    assert hybrid.description.startswith("offload/optimizer=states")  # HDO's CPU Adam at 0.27x


def test_step_cost_model() -> None:
    from offload_runner.hardware import CPU_ADAM_RATE_BESIDE_STREAMS as K
    from offload_runner.hardware import GPU_ADAM_S_PER_PARAM as G
    from offload_runner.hardware import HDO_RATE_SHARE
    from offload_runner.hardware import LINK_BESIDE_CPU_ADAM as L
    from offload_runner.step_cost import StepCost

    cost = StepCost(cpu_adam_params_per_s=4e9, host_link_gb_per_s=50.0)
    # exact mode's balanced GPU share x: the CPU's (1 - x) at 4e9 K params/s and the GPU's side,
    # the link's 12 x + 4 (1 - x) B/param at 50 L GB/s then x's Adam in the window, take as long
    on_cpu = (12 / (50e9 * L) + G) / (1 / (4e9 * K) + 8 / (50e9 * L) + G)
    balanced = on_cpu / (4e9 * K)
    for option, expected in (
        ("cpu_adam", balanced),
        ("cpu_adam optimizer.cpu_adam_gpu_share=0", 1 / 4e9),
        ("cpu_100", 1 / (4e9 * HDO_RATE_SHARE)),
        ("states", 10 / 50e9 + G),  # the stream, then the window's Adam
    ):
        run = compose_run("recipe=tiny", *f"offload/optimizer={option}".split())
        rank = make_plan(run).ranks[0]
        params = count_parameters(run.model).total
        assert cost.seconds(run, rank) == pytest.approx(params * expected, rel=1e-6), option
    assert (
        cost.seconds(compose_run("recipe=tiny"), make_plan(compose_run("recipe=tiny")).ranks[0])
        == 0
    )


def test_delayed_mode_hides_cpu_adam_under_forward_backward() -> None:
    """Delayed mode copying at the step boundary: the CPU update beyond
    planner.forward_backward_s and the boundary's copies (4 B/param each way at once) cost;
    unknown forward+backward hides nothing."""
    from offload_runner.step_cost import StepCost, hidden_fraction

    # tensor parallelism: Megatron-Core all-reduces gradients after the backward
    run = compose_run(
        "recipe=tiny",
        "offload/optimizer=cpu_adam_delayed",
        "parallel=tp2",
        "launcher.nproc_per_node=2",
        "optimizer.optimizer_offload_fraction=0.5",
    )
    rank = make_plan(run).ranks[0]
    params = rank.cpu_adam_params
    assert rank.boundary_params == params
    cpu, copies = params / 4e9, params * 4 / 50e9
    blind = StepCost(cpu_adam_params_per_s=4e9, host_link_gb_per_s=50.0)
    assert blind.seconds(run, rank) == pytest.approx(cpu + copies)
    assert blind.hidden_fraction(run, rank) is None
    short = StepCost(4e9, 50.0, forward_backward_s=cpu / 2, delayed_max_overhead=1e9)
    assert short.seconds(run, rank) == pytest.approx(cpu / 2 + copies)
    assert short.hidden_fraction(run, rank) == pytest.approx(0.25)  # the CPU's limit
    # the copies' limit: at 10% of forward+backward, 4 B/param at 50 GB/s of the whole shard
    tight = replace(short, delayed_max_overhead=0.1)
    assert tight.hidden_fraction(run, rank) == pytest.approx(0.1 * (cpu / 2) / (2 * copies))
    long = StepCost(4e9, 50.0, forward_backward_s=10 * cpu)
    assert long.seconds(run, rank) == pytest.approx(copies)
    assert long.hidden_fraction(run, rank) == 1.0
    exact = compose_run(
        "recipe=tiny",
        "offload/optimizer=cpu_adam",
        "optimizer.optimizer_offload_fraction=0.5",
        "optimizer.cpu_adam_gpu_share=0",
    )
    whole = make_plan(exact).ranks[0]  # one GPU: the whole shard (tensor parallelism's half)
    assert long.seconds(exact, whole) == pytest.approx(whole.cpu_adam_params / 4e9)
    assert hidden_fraction(2.0, 1e9, 4e9) == 0.5 and hidden_fraction(1.0, 1e9, 0) == 1.0
    assert hidden_fraction(2.0, 1e9, 4e9, copy_s_per_param=1e-9, max_overhead=0.5) == 0.25


def test_delayed_copies_during_the_backward_hide_in_the_last_backward() -> None:
    """On one GPU delayed mode copies during the last micro-batch's backward: of its copies only
    what outlasts that backward (BACKWARD_SHARE of one micro-batch's forward+backward) costs,
    and limits the hidden fraction. With data parallelism (Megatron-Core reduces the gradients
    after the backward) they wait for the step boundary again."""
    from offload_runner.step_cost import BACKWARD_SHARE, StepCost

    run = compose_run(
        "recipe=tiny",
        "offload/optimizer=cpu_adam_delayed",
        "optimizer.optimizer_offload_fraction=0.5",
    )
    rank = make_plan(run).ranks[0]
    params = rank.cpu_adam_params
    assert params and rank.boundary_params == 0
    micro = run.train.global_batch_size // run.train.micro_batch_size
    cpu, copies = params / 4e9, params * 4 / 50e9
    fb = 2 * micro * copies / BACKWARD_SHARE  # the last backward lasts twice the copies
    cost = StepCost(4e9, 50.0, forward_backward_s=fb, delayed_max_overhead=0.1)
    assert cost.seconds(run, rank) == pytest.approx(max(cpu - fb, 0.0))
    assert cost.hidden_fraction(run, rank) == pytest.approx(min(1.0, fb / cpu * 0.5))
    short = replace(cost, forward_backward_s=fb / 4)  # the copies outlast it by half of theirs
    assert short.seconds(run, rank) == pytest.approx(max(cpu - fb / 4, 0.0) + copies / 2)
    assert "copies beyond the last backward within 10%" in short.explain(run, rank)
    assert "during the last micro-batch's backward" in short.explain(run, rank)
    two = make_plan(run, world=2).ranks[0]
    assert two.boundary_params == two.cpu_adam_params > 0
    assert "at the step boundary" in cost.explain(run, two)


def test_delayed_experts_price_the_dense_part_exact_and_the_experts_hidden() -> None:
    """cpu_adam_delayed_scope=experts on a MoE rank with expert parallelism: the experts' params
    delayed (hidden under forward+backward, their copies at the step boundary), the dense
    part's exact with its GPU share (its moments page-locked, a window); all of Adam's states on
    the host as in delayed mode."""
    from offload_runner.hardware import CPU_ADAM_PAGEABLE_BYTES
    from offload_runner.step_cost import StepCost, exact_update_seconds

    common = ("recipe=tiny_moe", "planner.forward_backward_s=100", "parallel=ep2")
    mixed = compose_run(*common, "offload/optimizer=cpu_adam_delayed_experts")
    every = compose_run(*common, "offload/optimizer=cpu_adam_delayed")
    m, e = make_plan(mixed, world=2).ranks[0], make_plan(every, world=2).ranks[0]
    params = count_parameters(mixed.model)
    assert m.cpu_adam_params == e.cpu_adam_params == e.delayed_params
    assert m.delayed_params == pytest.approx(params.experts / 2, abs=1)  # EP2: half each
    dense = m.cpu_adam_params - m.delayed_params
    assert dense == pytest.approx((params.total - params.experts) / 2, abs=1) and dense > 0
    assert m.host == e.host  # the same bytes, the dense part's moments page-locked
    assert m.host_pinned - e.host_pinned == pytest.approx(dense * CPU_ADAM_PAGEABLE_BYTES, abs=8)
    assert m.step_peak > e.step_peak  # the dense part's state window
    cost = StepCost(4e9, 50.0, forward_backward_s=100.0)
    share = cost.gpu_share(mixed)
    assert 0 < share < 1 and cost.gpu_share(every) == 0
    # data parallel: the delayed copies wait for the step boundary, 4 B/param each way at once
    copies = e.delayed_params * 4 / 50e9
    assert e.boundary_params == e.delayed_params and m.boundary_params == m.delayed_params
    assert cost.seconds(every, e) == pytest.approx(copies)  # the CPU update itself hidden
    assert cost.seconds(mixed, m) == pytest.approx(
        exact_update_seconds(dense, 4e9, 50.0, share) + m.delayed_params * 4 / 50e9
    )
    text = cost.explain(mixed, m)
    assert "(the dense part, exact) on the host" in text and "(the routed experts)" in text


def test_delayed_mode_with_a_gpu_share_streams_states_and_gradients_beside_the_cpu() -> None:
    """Delayed mode with optimizer.cpu_adam_gpu_share: its moments page-locked and a window of
    16 B/param (states and gradients) held through forward+backward; the balanced share is
    where the CPU beside the streams and the link carrying 16 B/param for the GPU's share and
    every param's landing (4 B) finish together, which sets the rate the update hides under
    forward+backward at; weight prediction keeps every update on the CPU."""
    from offload_runner.hardware import (
        CPU_ADAM_PAGEABLE_BYTES,
        CPU_ADAM_RATE_BESIDE_STREAMS,
        GPU_ADAM_S_PER_PARAM,
        LATE_BYTES,
        LINK_BESIDE_CPU_ADAM,
    )
    from offload_runner.step_cost import StepCost

    common = ("recipe=tiny", "offload/optimizer=cpu_adam_delayed", "planner.forward_backward_s=1")
    cpu = compose_run(*common)
    shared = compose_run(*common, "optimizer.cpu_adam_gpu_share=null")
    a, b = make_plan(cpu).ranks[0], make_plan(shared).ranks[0]
    assert b.host == a.host and b.delayed_params == a.delayed_params == a.cpu_adam_params
    assert b.host_pinned - a.host_pinned == a.cpu_adam_params * CPU_ADAM_PAGEABLE_BYTES
    assert b.optimizer_gpu > a.optimizer_gpu and b.optimizer_step_only == a.optimizer_step_only
    cost = StepCost(4e9, 50.0, forward_backward_s=1.0)
    k, per_byte = 4e9 * CPU_ADAM_RATE_BESIDE_STREAMS, 1 / (50e9 * LINK_BESIDE_CPU_ADAM)
    g = GPU_ADAM_S_PER_PARAM  # the share's Adam in the window, after its pieces land
    share = cost.gpu_share(shared)  # the link also carries every param's landing, 4 B
    assert share == pytest.approx((1 / k - 4 * per_byte) / (1 / k + LATE_BYTES * per_byte + g))
    assert (1 - share) / k == pytest.approx((LATE_BYTES * share + 4) * per_byte + g * share)
    rate = k / (1 - share)
    assert cost.delayed_rate(shared) == pytest.approx(rate) and cost.gpu_share(cpu) == 0
    assert cost.delayed_rate(cpu) == cost.cpu_rate(cpu) == 4e9
    # the update outlasts forward+backward; the copies beyond the last of 2 backwards remain
    short = StepCost(4e9, 50.0, forward_backward_s=0.0005)
    assert short.delayed_seconds(shared, b) == pytest.approx(
        b.delayed_params / rate - 0.0005 + max(b.delayed_params * 4 / 50e9 - 0.0005 / 3, 0)
    )
    # the share pays where the link outruns what the CPU loses beside the streams
    fast = StepCost(4e9, 100.0, forward_backward_s=0.0005)
    assert fast.delayed_seconds(shared, b) < fast.delayed_seconds(cpu, a)
    assert "on the GPU, their states and gradients streamed" in cost.explain(shared, b)
    guessing = compose_run(
        *common, "optimizer.cpu_adam_gpu_share=null", "optimizer.cpu_adam_weight_prediction=true"
    )
    assert cost.gpu_share(guessing) == 0


def test_weight_prediction_costs_host_memory_and_cpu_time() -> None:
    """Predicting weights: 4 B/param more page-locked host memory, and the CPU step slower by
    WEIGHT_PREDICTION_CPU_FACTOR (its copy and extrapolation)."""
    from offload_runner.hardware import WEIGHT_PREDICTION_CPU_FACTOR
    from offload_runner.step_cost import StepCost

    plain = compose_run("recipe=tiny", "offload/optimizer=cpu_adam_delayed")
    guessing = compose_run(
        "recipe=tiny",
        "offload/optimizer=cpu_adam_delayed",
        "optimizer.cpu_adam_weight_prediction=true",
    )
    params = count_parameters(plain.model).total
    a, b = make_plan(plain).ranks[0], make_plan(guessing).ranks[0]
    assert b.host_pinned - a.host_pinned == pytest.approx(4 * params, rel=1e-6)
    cost = StepCost(4e9, 50.0)
    assert cost.cpu_rate(plain) / cost.cpu_rate(guessing) == pytest.approx(
        WEIGHT_PREDICTION_CPU_FACTOR
    )


def test_auto_delayed_takes_the_cheapest_delayed_fraction_that_fits() -> None:
    """planner.auto_delayed: the CPU-Adam engine in delayed mode; with forward+backward known,
    the smallest fraction that fits costs least (its copies), and the choice says how much of
    Adam would hide."""
    run = compose_run(
        "recipe=qwen3_30b_a3b_proxy",
        "train.global_batch_size=4",
        "offload/optimizer=auto",
        "planner.auto_delayed=true",
        "planner.forward_backward_s=0.6",
        "planner.gpu_memory_gb=48",
        "planner.host_memory_gb=512",
        "planner.cpu_adam_launch_slowdown=0",
        "planner.cpu_adam_params_per_s=3.7e9",
    )
    choice = choose_offload(run)
    assert choice.overrides["optimizer.cpu_adam_delayed_update"] is True
    assert choice.overrides["optimizer.optimizer_offload_fraction"] == 0.5
    assert choice.description.startswith(
        "offload/optimizer=cpu_adam_delayed optimizer.optimizer_offload_fraction=0.5"
    )
    # its CPU Adam would hide up to 0.6 s x 3.7e9 / 3.11B = 0.71; on one GPU its copies (4
    # B/param at 50.8 GB/s) run during the last of 4 backwards (0.1 s) and may outlast it by
    # 10% of 0.6 s: up to 0.65; copying at the boundary, within 10% of 0.6 s: up to 0.24
    assert "up to a fraction of 0.65 (copies beyond the last backward" in choice.description
    # CPU Adam slowing the training thread by 0.25 s per second beside it (0.21 s per unit of
    # fraction) leaves 0.06 / 0.21 = 0.29 where the copies run during the backward
    run.planner.cpu_adam_launch_slowdown = 0.25
    assert "up to a fraction of 0.29 (copies beyond the last backward and the training " in (
        choose_offload(run).description
    )


def test_plan_prints_the_predicted_step_cost(capsys) -> None:
    code = main(
        [
            "--recipe",
            "tiny",
            "offload/optimizer=cpu_adam_delayed",
            "planner.cpu_adam_params_per_s=1e9",
            "planner.forward_backward_s=0.5",
            "--plan",
        ]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert code == EXIT_OK
    assert "predicted +0.00 s per step" in out and "delayed: hidden under forward+backward" in out


def test_precision_aware_optimizer_keeps_param_remainders_not_fp32_masters() -> None:
    """10 B of Adam per param on the GPU precision-aware path (2 B master remainder), 12 B else."""
    params = count_parameters(compose_run("recipe=tiny").model).total
    plain = make_plan(compose_run("recipe=tiny")).ranks[0]
    aware = make_plan(compose_run("recipe=tiny", "optimizer.use_precision_aware_optimizer=true"))
    assert plain.optimizer_gpu == pytest.approx(12 * params, rel=1e-6)
    assert aware.ranks[0].optimizer_gpu == pytest.approx(10 * params, rel=1e-6)


def test_precision_aware_dtypes_shrink_adam_and_reach_megatron_core() -> None:
    import torch

    from offload_runner.mcore.megatron_config import optimizer_config_kwargs

    bf16 = ("optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16")
    run = compose_run("recipe=tiny", "optimizer.use_precision_aware_optimizer=true", *bf16)
    params = count_parameters(run.model).total
    assert make_plan(run).ranks[0].optimizer_gpu == pytest.approx(6 * params, rel=1e-6)
    kwargs = optimizer_config_kwargs(run.optimizer, run.model)
    assert (
        kwargs["exp_avg_dtype"] is torch.bfloat16 and kwargs["main_params_dtype"] is torch.float32
    )


FULL_4GPU = (
    "--recipe",
    "qwen3_30b_a3b",
    "train.global_batch_size=16",
    "train.micro_batch_size=1",
    "planner.gpu_memory_gb=139",
    "planner.host_memory_gb=500",
    "launcher.nproc_per_node=4",
)
CPU_ADAM_50 = ("offload/optimizer=cpu_adam", "optimizer.optimizer_offload_fraction=0.5")


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel=ep4",),
        ("parallel=ep4", *CPU_ADAM_50),
        ("parallel=ep4", "offload/optimizer=cpu_50"),
        ("parallel=ep4", "offload/optimizer=states"),
        ("parallel=pp2_ep2", *CPU_ADAM_50),
    ],
)
def test_plan_verdicts_of_the_full_model_on_four_gpus(layout: tuple, capsys) -> None:
    """The whole Qwen3-30B-A3B on one 4-GPU node, planned for four 139 GB GPUs and 500 GB of
    RAM: no offload does not fit (exit 1); every offloaded command line fits (exit 0)."""
    argv = [*FULL_4GPU, *layout, "--plan"]
    offloaded = any(o.startswith("offload/") for o in layout)
    assert main(argv) == (EXIT_OK if offloaded else EXIT_FAILED)
    assert ("fits: peak" if offloaded else "does not fit") in capsys.readouterr().out


def test_state_offload_fraction_and_bf16_moments_in_the_plan() -> None:
    """Host bytes of state offload: 10 per offloaded param (the master's remainder and fp32
    moments), 6 with bf16 moments; the fraction keeps the rest on the GPU (8 B each with bf16
    moments: fp32 master, bf16 moments); the link carries what is on the host. Megatron-Core's
    dev spelling plans the same."""
    base = ("recipe=tiny", "offload/optimizer=states")
    bf16 = ("optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16")
    whole = make_plan(compose_run(*base)).ranks[0]
    small = make_plan(compose_run(*base, *bf16)).ranks[0]
    half = make_plan(compose_run(*base, *bf16, "optimizer.optimizer_state_offload_fraction=0.5"))
    half = half.ranks[0]
    shard = whole.states_moved / 10
    assert whole.optimizer_gpu == 0 and small.optimizer_gpu == 0
    assert small.states_moved == pytest.approx(6 * shard, rel=1e-6)
    assert whole.host_pinned - small.host_pinned == pytest.approx(4 * shard, rel=1e-6)
    assert half.states_moved == pytest.approx(3 * shard, rel=1e-3)
    assert half.optimizer_gpu == pytest.approx(4 * shard, rel=1e-3)
    assert small.host_pinned - half.host_pinned == pytest.approx(3 * shard, rel=1e-3)
    dev = make_plan(compose_run("recipe=tiny", "optimizer.chunked_optimizer_state_offload=true"))
    assert dev.ranks[0] == whole
    chunked = compose_run(*base, "optimizer.optimizer_state_offload_chunk_size_mb=1")
    assert make_plan(chunked).ranks[0].optimizer_step_only == 4 * 1024**2


def test_plan_largest_finds_the_most_layers_that_fit(capsys) -> None:
    """--plan --largest: a bisection over model.num_layers; the answer fits and one step more
    does not (auto's choice at each size where auto is on). On one H200 box the whole model
    fits with 8-bit moments; on half its host memory a slice does."""
    from offload_runner.auto import largest_slice

    common = (
        "recipe=qwen3_30b_a3b",
        "parallel=single",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "planner.gpu_memory_gb=139",
        "planner.host_memory_gb=125",
    )
    whole = largest_slice(compose_run(*common, "offload/optimizer=auto"))
    assert whole.layers == 48 and "8bit moments" in whole.choice.description
    half = (*common, "offload/optimizer=auto", "planner.host_memory_gb=48")
    found = largest_slice(compose_run(*half))
    assert 28 <= found.layers < 48 and found.choice is not None
    over = compose_run(*half, f"model.num_layers={found.layers + 1}")
    with pytest.raises(ValueError):
        choose_offload(over)
    plain = largest_slice(compose_run(*common))  # no offload: far fewer layers
    assert 0 < plain.layers < found.layers and plain.choice is None
    assert main(["--recipe", "qwen3_30b_a3b", *common[1:], "--plan", "--largest"]) == EXIT_OK
    assert f"model.num_layers={plain.layers}," in capsys.readouterr().out
    assert main(["--recipe", "tiny", "--largest"]) == EXIT_USAGE


def test_two_ranks_keep_room_for_nccl_and_share_the_hosts_link() -> None:
    """The full model on two H200 (EP2): auto's first pick, states at 90%, planned 133.3 GB and
    ran out of memory beside NCCL's 3.9 GiB (suite two-gpu-full-2); auto's pick now keeps
    NCCL's room free, and each rank's link is its share of the node's."""
    from offload_runner.hardware import NODE_HOST_LINKS, rank_link_gb_per_s
    from offload_runner.plan import COMMUNICATOR_GB, make_plan

    full = (
        "recipe=qwen3_30b_a3b",
        "speed=plain",
        "parallel=ep2",
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "planner.gpu_memory_gb=139",
        "planner.host_memory_gb=250",
        "launcher.nproc_per_node=2",
    )
    choice = choose_offload(compose_run(*full, "offload/optimizer=auto"))
    assert choice.overrides["optimizer.offload_optimizer_states"] is True
    assert choice.plan.worst.gpu_peak / 1024**3 + choice.plan.gpu_kept_free_gb <= 139
    assert "kept free" in choice.description and "over 39 GB/s" in choice.description
    plan = make_plan(compose_run(*full, "offload/optimizer=states"))
    assert plan.gpu_kept_free_gb == plan.margin_gb + COMMUNICATOR_GB
    single = make_plan(compose_run("recipe=tiny", "planner.gpu_memory_gb=80"))
    assert single.gpu_kept_free_gb == single.margin_gb
    assert rank_link_gb_per_s(50.8, 1) == 50.8
    assert rank_link_gb_per_s(50.8, 2) == pytest.approx(50.8 * NODE_HOST_LINKS / 2)
    assert rank_link_gb_per_s(50.8, 8) == pytest.approx(78.0 / 8)


def test_bf16_moments_move_the_balanced_gpu_share() -> None:
    """With bf16 moments the GPU share's states move 8 B/param, not 12, and the engine's CPU Adam
    runs at BF16_MOMENTS_CPU_FACTOR of its fp32-moment rate, so the balance moves towards the
    GPU."""
    from offload_runner.hardware import BF16_MOMENTS_CPU_FACTOR
    from offload_runner.hardware import CPU_ADAM_RATE_BESIDE_STREAMS as K
    from offload_runner.hardware import GPU_ADAM_S_PER_PARAM as G
    from offload_runner.hardware import LINK_BESIDE_CPU_ADAM as L
    from offload_runner.step_cost import StepCost

    cost = StepCost(4e9, 50.0)
    fp32 = compose_run("recipe=tiny", "offload/optimizer=cpu_adam")
    bf16 = compose_run(
        "recipe=tiny",
        "offload/optimizer=cpu_adam",
        "optimizer.exp_avg_dtype=bf16",
        "optimizer.exp_avg_sq_dtype=bf16",
    )
    assert cost.moved(fp32) == (12, 4, 0) and cost.moved(bf16) == (8, 4, 0)
    assert cost.exact_rate(bf16) == pytest.approx(4e9 * BF16_MOMENTS_CPU_FACTOR)
    k, per_byte = 4e9 * BF16_MOMENTS_CPU_FACTOR * K, 1 / (50e9 * L)
    share = cost.gpu_share(bf16)
    assert (1 - share) / k == pytest.approx((8 * share + 4 * (1 - share)) * per_byte + G * share)
    assert share > cost.gpu_share(fp32)


def test_the_launcher_hands_its_cpu_adam_rate_to_the_ranks(monkeypatch) -> None:
    """The launcher times fused AdamW once (or auto did) and writes the rate into the ranks'
    config, so no rank times it again at its start; not where the run sets the rate, runs no
    CPU-Adam engine or times nothing (deterministic mode)."""
    from offload_runner import cli, step_cost
    from offload_runner.config.compose import compose_config, to_run_config

    timed = []
    monkeypatch.setattr(step_cost, "measured_rate", lambda threads: timed.append(threads) or 3.3e9)
    assert (
        step_cost.rate_for_ranks(compose_run("recipe=tiny", "offload/optimizer=cpu_adam"), 1)
        == 3.3e9
    )
    for unpinned in (
        ("offload/optimizer=cpu_adam", "planner.cpu_adam_params_per_s=2e9"),
        ("offload/optimizer=cpu_adam", "model.deterministic_mode=true"),
        ("offload/optimizer=states",),
        (),
    ):
        assert step_cost.rate_for_ranks(compose_run("recipe=tiny", *unpinned), 1) is None
    assert len(timed) == 1
    cfg = compose_config(["recipe=tiny", "offload/optimizer=cpu_adam"])
    job = cli._Job(cfg, to_run_config(cfg), cli.Mode.train, 1)
    cli._pin_cpu_adam_rate(job)
    assert job.run.planner.cpu_adam_params_per_s == 3.3e9
    assert cli._resolved(job)["planner"]["cpu_adam_params_per_s"] == 3.3e9


def test_a_model_whose_ddp_copy_cannot_fit_goes_through_the_host(monkeypatch) -> None:
    """DDP's buffers beside the parameters: the whole model's 2 x 61 GB of weights and 61 GB of
    bf16 gradients do not fit one H200, the 37-layer slice's do."""
    import torch

    from offload_runner.mcore.model import through_host

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (139 * 1024**3, 140 * 1024**3))
    common = ("recipe=qwen3_30b_a3b", "parallel=single", "ddp.grad_reduce_in_fp32=false")
    assert through_host(compose_run(*common))
    assert not through_host(compose_run(*common, "model.num_layers=37"))
    assert through_host(compose_run(*common, "model.num_layers=37", "train.gpu_memory_cap_gb=100"))
    ring = ("offload/weight=enabled", "model.cpu_offloading_num_layers=4")
    assert not through_host(compose_run(*common, *ring))  # its ring moves the weights itself


def test_the_plan_says_when_the_model_goes_through_the_host() -> None:
    common = ("recipe=qwen3_30b_a3b", "parallel=single", "planner.gpu_memory_gb=139")
    whole = make_plan(compose_run(*common, "ddp.grad_reduce_in_fp32=false"))
    assert any("goes through host memory" in n for n in whole.notes)
    sliced = make_plan(compose_run(*common, "model.num_layers=37", "ddp.grad_reduce_in_fp32=false"))
    assert not any("goes through host memory" in n for n in sliced.notes)
