#!/usr/bin/env bash
# The GPU evidence of docs/BENCHMARKS.md, one step per device call (each under 10 minutes):
#   bash bench/device_session.sh STEP   (the steps are the cases below)
# Run from the project root on the GPU machine with megatron-core and TE importable; results go
# to $OUT (default ./device-out). Every number comes from a real run_recipe.py training run.
set -euo pipefail
OUT=${OUT:-device-out}
WORK=${WORK:-/tmp/offload-runner}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# The commit the results record: give it (the device's copy of .git may lag the working tree it
# was sent, so its HEAD is not trusted), e.g. OFFLOAD_RUNNER_COMMIT=$(git rev-parse --short HEAD) here.
: "${OFFLOAD_RUNNER_COMMIT:?set OFFLOAD_RUNNER_COMMIT to the commit whose working tree was sent}"
export OFFLOAD_RUNNER_COMMIT
PROXY=(--recipe qwen3_30b_a3b_proxy train.global_batch_size=4 train.micro_batch_size=1)
bench() { python bench/run_benchmarks.py run --suite "$1" --out "$OUT/results-$1.json" --work-dir "$WORK/bench"; }
gpu_tests() {  # gpu_tests PYTEST_K NAME: the gpu-marked tests selected by -k, their verdicts to $OUT
  timeout "${TEST_TIMEOUT:-560}" python -m pytest -v -s -m gpu -k "$1" tests/ 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|max \|Δloss\||params/s|passed|failed|Error" \
    | tee "$OUT/pytest-gpu-$2.txt" || true
}

case "$1" in
  tests)  # every gpu-marked pytest test (on all visible GPUs: data parallel over them)
    timeout 560 python -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -15 || true ;;
  resume)  # checkpoint resume only: GPU Adam, state offload, HybridDeviceOptimizer 50%
    timeout 560 python -m pytest -q -m gpu -k resume tests/ 2>&1 | tee "$OUT/pytest-gpu-resume.txt" | tail -8 || true ;;
  states)  # optimizer-state offload (window sizes, whole tensors) beside the baseline and cpu_adam,
    # after a 4-iteration smoke run of the tiny recipe (stops here if that fails)
    python run_recipe.py --recipe tiny offload/optimizer=states train.train_iters=4 \
      output_dir="$WORK/smoke-states" > "$OUT/smoke-states.log" 2>&1 || { tail -40 "$OUT/smoke-states.log"; exit 1; }
    python bench/run_benchmarks.py run --suite states --iters 12 \
      --out "$OUT/results-states.json" --work-dir "$WORK/bench" ;;
  states-extra)  # proxy bit-parity, and a 32k sequence (forward/backward set the peak)
    python bench/run_benchmarks.py run --suite states-proxy-det --iters 12 \
      --out "$OUT/results-states-proxy-det.json" --work-dir "$WORK/bench"
    python bench/run_benchmarks.py run --suite states-long --iters 12 \
      --out "$OUT/results-states-long.json" --work-dir "$WORK/bench" ;;
  state-tests)  # state offload gpu tests, beside (same GPU) the long delayed runs after 20 and
    # 50 exact steps (their losses matter here, not their speed)
    for n in 3 4; do
      python bench/run_benchmarks.py run --suite cpu-adam-long-$n --iters 200 \
        --out "$OUT/results-cpu-adam-long-$n.json" --work-dir "$WORK/bench-$n" > "$OUT/long-$n.log" 2>&1 &
    done
    gpu_tests state engines-states; wait; tail -2 "$OUT"/long-*.log ;;
  engine-tests)  # the rest of the CPU-Adam gpu tests (cross-engine checkpoints, delayed resume)
    # and TensorBoard, beside every conf/offload option training (exit codes and losses matter)
    python bench/run_benchmarks.py run --suite options-1 --iters 8 \
      --out "$OUT/results-options-1.json" --work-dir "$WORK/bench" > "$OUT/options.log" 2>&1 &
    gpu_tests "tensorboard or (moves_between and not states) or (resume and delayed)" engines-rest
    wait; tail -3 "$OUT/options.log" ;;
  two-gpu-states)  # (two GPUs) DP2 with and without state offload, then resume on DP2: state
    # offload and cpu_adam_delayed
    python bench/run_benchmarks.py run --suite two-gpu-states --iters 12 \
      --out "$OUT/results-two-gpu-states.json" --work-dir "$WORK/bench"
    # beside the tests, on GPU 0 alone: exact mode's long run again (its noise; losses only)
    CUDA_VISIBLE_DEVICES=0 python bench/run_benchmarks.py run --suite cpu-adam-long-5 --iters 200 \
      --out "$OUT/results-cpu-adam-long-5.json" --work-dir "$WORK/bench-5" > "$OUT/long-5.log" 2>&1 &
    gpu_tests "resume and (states or delayed)" states-dp2; wait; tail -2 "$OUT/long-5.log" ;;
  determinism)  # MoE proxy twice with deterministic algorithms
    bench proxy-det ;;
  verify)  # --verify on the MoE proxy (with a repeated baseline: the noise floor) and tiny
    python run_recipe.py "${PROXY[@]}" offload/optimizer=cpu_50 verify.repeat_baseline=true \
      --verify output_dir="$WORK/verify-proxy-cpu50" | tail -40 || true
    python run_recipe.py --recipe tiny offload/optimizer=states --verify \
      output_dir="$WORK/verify-tiny-states" | tail -12 || true
    for d in verify-proxy-cpu50 verify-tiny-states; do
      cp "$WORK/$d/verify.md" "$OUT/$d.md"; cp "$WORK/$d/verify.json" "$OUT/$d.json"; done ;;
  sweep)  # HDO fraction sweep through Hydra multirun, collected into a table and a plot
    rm -rf "$WORK/sweep"
    python run_recipe.py -m "${PROXY[@]}" train.train_iters=10 optimizer.optimizer_cpu_offload=true \
      optimizer.optimizer_offload_fraction=0,0.25,0.5,0.75,1.0 hydra.sweep.dir="$WORK/sweep" \
      2>&1 | grep -E "job|error|summary|step_time|gpu_peak" || true
    python run_recipe.py --collect "$WORK/sweep"
    cp "$WORK/sweep/sweep.md" "$WORK/sweep/sweep.json" "$WORK/sweep/sweep.png" "$OUT/" ;;
  dense)  # a larger dense model for the planner's calibration
    bench dense ;;
  two-gpu)  # (two GPUs) resume on DP2, then tiny DP2 and proxy EP2 with and without HDO 50%
    timeout 330 python -m pytest -q -m gpu -k resume tests/ 2>&1 | tee "$OUT/pytest-gpu-resume.txt" | tail -8 || true
    bench two-gpu ;;
  cp-tests)  # (two GPUs) context parallelism: the CP loss arithmetic on gloo, CP2 against DP2
    timeout 330 python -m pytest -q -rP tests/test_train_cpu.py tests/test_gpu_training.py \
      -k "context_parallel or same_seed or cp2" 2>&1 | tee "$OUT/pytest-gpu-cp-h200x2.txt" | tail -12 || true ;;
  two-gpu-cp)  # (two GPUs) tiny and a 32k-token proxy: CP2 against DP2, and CP2 with state offload
    bench two-gpu-cp ;;
  cpu-adam-1|cpu-adam-4)  # the CPU-Adam engine at GBS 1 (4) beside the baseline and HDO 100% +
    # overlap; delayed mode at the fraction its 100% run found hidden; the baseline again (its
    # spread within the call); delayed mode for the routed experts only
    python bench/run_benchmarks.py run --suite "$1" --iters 12 --time-limit 570 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  cpu-adam-split-4|cpu-adam-split-1)  # exact mode with its GPU share balanced each step against
    # all of Adam on the CPU, beside the baseline (twice) and HDO 100% + overlap
    python bench/run_benchmarks.py run --suite "$1" --iters 12 --time-limit 570 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  split-probe-tests)  # the CPU/GPU split outside the engine (bench/cpu_gpu_split_probe.py), then
    # exact mode's gpu tests: all on the CPU against HDO, the GPU share, resume
    OMP_WAIT_POLICY=PASSIVE timeout 120 python bench/cpu_gpu_split_probe.py 2>&1 \
      | tee "$OUT/cpu-gpu-split-probe.txt"
    TEST_TIMEOUT=450 gpu_tests "cpu_adam_matches or gpu_share" cpu-adam-split ;;
  split-tests)  # the GPU share's gpu tests: against all on the CPU, resume (with and without a
    # share), the MoE model's two engines all on the CPU against HDO
    TEST_TIMEOUT=570 gpu_tests "gpu_share or cpu_adam_moe or (resume and cpu-adam and not \
delayed and not 50 and not all)" cpu-adam-split ;;
  cpu-adam-1-exact-1|cpu-adam-1-exact-2)  # cpu-adam-1's baseline and HDO 100% + overlap (-1),
    # cpu_adam 100% (-2), 12 iterations: one table from two calls on the same machine
    python bench/run_benchmarks.py run --suite "$1" --iters 12 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  cpu-adam-sweep)  # offload fraction 0.25 ... 0.75: cpu_adam, cpu_adam_delayed; HDO 50%
    python bench/run_benchmarks.py run --suite cpu-adam-sweep --iters 8 \
      --out "$OUT/results-cpu-adam-sweep.json" --work-dir "$WORK/bench" ;;
  cpu-adam-dp2)  # (two GPUs) the engine on DP2, and resume of both modes there
    python bench/run_benchmarks.py run --suite cpu-adam-dp2 --iters 10 \
      --out "$OUT/results-cpu-adam-dp2.json" --work-dir "$WORK/bench"
    timeout 200 python -m pytest -q -rP -m gpu -k "resume and cpu-adam and not 50" tests/ 2>&1 \
      | tee "$OUT/pytest-gpu-cpu-adam-dp2.txt" | tail -8 || true ;;
  cpu-adam-long)  # 200 iterations, delayed against exact
    python bench/run_benchmarks.py run --suite cpu-adam-long --iters 200 \
      --out "$OUT/results-cpu-adam-long.json" --work-dir "$WORK/bench" ;;
  adam-parity)  # Adam's kernels against each other on the tiny recipe (GPU: torch, TE; CPU: the
    # engine both ways, HDO), then the engine's exact-mode gpu tests (dense and MoE)
    bench adam-parity
    gpu_tests "cpu_adam_matches or cpu_adam_moe" cpu-adam-exact ;;
  cpu-adam-4-delayed)  # cpu-adam-4's delayed-mode rows alone (baseline, 100%, hidden fraction, repeat)
    python bench/run_benchmarks.py run --suite cpu-adam-4-delayed --iters 12 --time-limit 330 \
      --out "$OUT/results-cpu-adam-4-delayed.json" --work-dir "$WORK/bench" ;;
  cpu-adam-landing)  # exact mode landing during the next forward against within the step
    python bench/run_benchmarks.py run --suite cpu-adam-landing --iters 12 --time-limit 570 \
      --out "$OUT/results-cpu-adam-landing.json" --work-dir "$WORK/bench" ;;
  delayed-tests)  # delayed mode's gpu tests: one step late (during the backward and at the
    # boundary), resume with and without weight prediction
    TEST_TIMEOUT=570 gpu_tests "delayed_lands or (resume and delayed)" cpu-adam-delayed ;;
  cpu-adam-tests)  # the engine's gpu tests: parity with GPU Adam, delayed mode, resume
    timeout 560 python -m pytest -q -rP -m gpu -k "cpu_adam or cpu-adam" tests/ 2>&1 \
      | tee "$OUT/pytest-gpu-cpu-adam.txt" | tail -15 || true ;;
  cpu-adam-dp2-tests)  # (two GPUs) the engine's gpu tests on DP2, beside the long delayed run
    python bench/run_benchmarks.py run --suite cpu-adam-long-2 --iters 200 \
      --out "$OUT/results-cpu-adam-long-2.json" --work-dir "$WORK/bench" > "$OUT/long.log" 2>&1 &
    timeout 540 python -m pytest -v -s -m gpu -k "cpu_adam or cpu-adam" tests/ 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|max \|Δloss\||params/s|passed|failed|Error" \
      | tee "$OUT/pytest-gpu-cpu-adam-dp2.txt" || true
    wait; tail -3 "$OUT/long.log" ;;
  cpu-adam-long-tests)  # both at once: the long run's losses matter, not its speed
    bash "$0" cpu-adam-long > "$OUT/long.log" 2>&1 &
    bash "$0" cpu-adam-tests; wait; tail -4 "$OUT/long.log" ;;
  full-4gpu-1|full-4gpu-2|full-4gpu-3)  # (four GPUs) the full Qwen3-30B-A3B: no offload (oom), the least
    # offload that fits, PP2 (-1); state offload, HDO 50% (-2). TIME_LIMIT: seconds for the suite
    python bench/run_benchmarks.py run --suite "$1" --iters 20 --time-limit "${TIME_LIMIT:-530}" \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  two-agents)  # (four GPUs) launcher=multinode: two torchrun agents of two GPUs each meeting on
    # localhost, against one agent of four GPUs, deterministic: the same losses
    C=(--recipe qwen3_30b_a3b_proxy parallel=ep4 model.deterministic_mode=true
       train.global_batch_size=8 train.micro_batch_size=1 train.train_iters=10)
    python run_recipe.py "${C[@]}" launcher.nproc_per_node=4 output_dir="$WORK/one-agent" \
      > "$OUT/one-agent.log" 2>&1 || true
    for r in 0 1; do
      CUDA_VISIBLE_DEVICES=$((2 * r)),$((2 * r + 1)) python run_recipe.py "${C[@]}" launcher=multinode \
        launcher.nnodes=2 launcher.nproc_per_node=2 launcher.node_rank=$r \
        launcher.rdzv_endpoint=localhost:29400 output_dir="$WORK/two-agents" > "$OUT/agent$r.log" 2>&1 &
    done
    wait
    python bench/compare_losses.py "$WORK/one-agent" "$WORK/two-agents" | tee "$OUT/two-agents.txt" ;;
  full-resume)  # (four GPUs) resume on the PP2 EP2 layout with cpu_adam 50%: the full model's
    # width at 4 of its 48 layers (a 48-layer checkpoint, 14 B/param, would not fit on the disk)
    R=(--recipe qwen3_30b_a3b model.num_layers=4 parallel=pp2_ep2 offload/optimizer=cpu_adam
       optimizer.optimizer_offload_fraction=0.5 train.global_batch_size=16 train.micro_batch_size=1
       scheduler.lr_warmup_iters=2 model.deterministic_mode=true launcher.nproc_per_node=4)
    python run_recipe.py "${R[@]}" train.train_iters=6 output_dir="$WORK/resume-full" > "$OUT/resume.log" 2>&1
    python run_recipe.py "${R[@]}" train.train_iters=3 scheduler.lr_decay_iters=6 \
      checkpoint.save="$WORK/ckpt-full" output_dir="$WORK/resume-first" >> "$OUT/resume.log" 2>&1
    python run_recipe.py "${R[@]}" train.train_iters=6 checkpoint.load="$WORK/ckpt-full" \
      output_dir="$WORK/resume-second" >> "$OUT/resume.log" 2>&1
    du -sh "$WORK/ckpt-full" | tee "$OUT/full-resume.txt"
    python bench/compare_losses.py "$WORK/resume-full" "$WORK/resume-second" --tail 3 \
      | tee -a "$OUT/full-resume.txt" ;;
  four-gpu-side)  # (four GPUs, one job per pair or GPU, side by side; what ran at commit
    # d88003d): resume of state offload and delayed mode on DP2 (GPUs 0-1), every HDO option then
    # the MoE calibration spread (GPU 2), the dense calibration spread (GPU 3)
    B=(python bench/run_benchmarks.py run)
    (CUDA_VISIBLE_DEVICES=0,1 TEST_TIMEOUT=440 gpu_tests "resume and (states or delayed)" states-dp2) &
    (export CUDA_VISIBLE_DEVICES=2
     timeout 220 "${B[@]}" --suite options-2 --iters 8 --time-limit 190 \
       --out "$OUT/results-options-2.json" --work-dir "$WORK/b2"
     timeout 220 "${B[@]}" --suite spread-2 --iters 4 --time-limit 200 \
       --out "$OUT/results-spread-2.json" --work-dir "$WORK/b2") > "$OUT/gpu2.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=3 timeout 440 "${B[@]}" --suite spread-1 --iters 4 --time-limit 420 \
      --out "$OUT/results-spread-1.json" --work-dir "$WORK/b3" > "$OUT/gpu3.log" 2>&1 &
    wait; tail -n 8 "$OUT"/gpu*.log ;;
  bridge-gpu)  # (four GPUs, side by side) GPUs 0-1: PP2 x VPP2 resume with fully parallel saves and
    # an offline W&B run (wandb from the wheels carried in .gpu/wb); GPU 2: every conf/offload option
    # (options-2: HDO 75% as itself first), alone on its GPU
    python3 -m pip install -q --no-index --find-links .gpu/wb --target /tmp/wbsite wandb
    export PYTHONPATH="${PYTHONPATH:-}:/tmp/wbsite"
    (CUDA_VISIBLE_DEVICES=0,1 TEST_TIMEOUT=400 gpu_tests "pp2-vpp2 or wandb" bridge) &
    CUDA_VISIBLE_DEVICES=2 timeout 420 python bench/run_benchmarks.py run --suite options-2 \
      --iters 8 --time-limit 400 --out "$OUT/results-options-2.json" --work-dir "$WORK/b2" \
      > "$OUT/gpu2.log" 2>&1 &
    wait; tail -n 12 "$OUT/gpu2.log" ;;
  cpu-adam-experts-ep2)  # (two GPUs) every state on the host, the experts delayed and the dense
    # part exact, beside delayed and exact mode at 100% and the baseline (twice), all EP2 (the
    # experts' own optimizer part); then its gpu test
    TEST_TIMEOUT=200 gpu_tests "delayed_experts" cpu-adam-delayed-experts-h200x2
    python bench/run_benchmarks.py run --suite "$1" --iters 12 --time-limit 350 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  cpu-adam-late-share-4|cpu-adam-late-share-1)  # delayed mode with its GPU share against all on
    # the CPU; -4 after the gpu tests of the GPU share (exact and delayed)
    if [ "$1" = cpu-adam-late-share-4 ]; then
      TEST_TIMEOUT=300 gpu_tests "gpu_share" cpu-adam-late-share
    fi
    python bench/run_benchmarks.py run --suite "$1" --out "$OUT/results-$1.json" \
      --work-dir "$WORK/bench" ;;
  cpu-adam-ep2-conv-1|cpu-adam-ep2-conv-2|cpu-adam-ep2-conv-3)  # (two GPUs) the experts' updates
    # delayed and the dense part's exact against the baseline over 200 iterations, all EP2: -1 and
    # -2 one seed each (baseline, then delayed experts), -3 exact mode beside them (one seed)
    python bench/run_benchmarks.py run --suite "$1" --iters 200 --time-limit 560 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  cpu-adam-conv-a|cpu-adam-conv-b|cpu-adam-conv-c|cpu-adam-conv-d|cpu-adam-conv-e)  # (two GPUs, side by side) delayed mode's
    # convergence: -a and -b one seed each, its no-offload run on GPU 0 and its delayed run on GPU
    # 1; -c delayed mode with weight prediction, both seeds. Each run has its GPU's share of the
    # cores (their losses matter here, not their speed). Beside them on both GPUs, in -b: the
    # engine's resume tests on DP2 (delayed mode, 50%) and an offline W&B run (wandb from the
    # wheels carried in .gpu/wb); in -c: delayed mode's tests (resume, one step late) on DP2
    # -d: delayed updates for the routed experts only (the dense part exact on the GPU), both seeds;
    # -e: the same with weight prediction
    case "$1" in cpu-adam-conv-a) suites=(1 3) ;; cpu-adam-conv-b) suites=(2 4) ;;
      cpu-adam-conv-c) suites=(5 6) ;; cpu-adam-conv-d) suites=(7 8) ;; *) suites=(9 10) ;; esac
    for i in 0 1; do
      cpus=$(python -c "from offload_runner.hardware import rank_cpus; from offload_runner.offload.cpu_adam import cpu_ranges
print(cpu_ranges(rank_cpus($i, 2)))" 2>/dev/null)
      pin=(); [ -n "$cpus" ] && pin=(taskset -c "$cpus")
      echo "GPU $i: suite cpu-adam-conv-${suites[$i]}, cores ${cpus:-all}"
      CUDA_VISIBLE_DEVICES=$i timeout 570 "${pin[@]}" python bench/run_benchmarks.py run \
        --suite "cpu-adam-conv-${suites[$i]}" --iters 200 \
        --out "$OUT/results-cpu-adam-conv-${suites[$i]}.json" --work-dir "$WORK/conv-$i" \
        > "$WORK/conv-$i.log" 2>&1 &
    done
    if [ "$1" = cpu-adam-conv-b ]; then
      python3 -m pip install -q --no-index --find-links .gpu/wb --target /tmp/wbsite wandb || true
      (export PYTHONPATH="${PYTHONPATH:-}:/tmp/wbsite"; TEST_TIMEOUT=560 \
        gpu_tests "(resume and (cpu-adam-delayed or cpu-adam-50)) or wandb" cpu-adam-dp2)
    elif [ "$1" = cpu-adam-conv-c ]; then
      TEST_TIMEOUT=560 gpu_tests "cpu_adam_delayed or (resume and cpu-adam-delayed)" predicting-dp2
    fi
    wait; tail -n 2 "$WORK"/conv-*.log ;;
  options-1|options-2)  # every conf/offload option and fine-grained offload, each trains (GBS 4)
    python bench/run_benchmarks.py run --suite "$1" --iters 8 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  profile-4)  # GBS 4: baseline, its precision-aware twin and cpu_adam 100%, iterations 6-7 profiled
    for c in "base|" "pao|optimizer.use_precision_aware_optimizer=true" "cpu_adam|offload/optimizer=cpu_adam"; do
      name=${c%%|*}; extra=${c#*|}
      python run_recipe.py "${PROXY[@]}" train.train_iters=8 $extra output_dir="$WORK/profile-$name" \
        profiling.use_pytorch_profiler=true profiling.profile_step_start=6 profiling.profile_step_end=7 \
        2>&1 | grep -E "error|summary|step_time|fwd_bwd|profile" || true
      cp "$WORK/profile-$name/profile/rank0-ops.txt" "$OUT/ops-$name.txt" || true
      cp "$WORK/profile-$name/summary.json" "$OUT/summary-$name.json" || true
      python bench/profile_summary.py "$WORK/profile-$name/profile/rank0.json.gz" | tee "$OUT/trace-$name.txt" | head -20
    done ;;
  profile-mb)  # GBS 8: no offload, cpu_adam, states, iteration 6 profiled (to PROFILE_END: 7
    # puts 7's forward beside 6's update in the window): each micro-batch's host span and GPU
    # busy time (bench/profile_summary.py), where forward+backward slows; with PROFILE_END set,
    # where the forward's thread waited and which copies waited for the copy engines
    end=${PROFILE_END:-6}
    for c in "base|" "cpu_adam|offload/optimizer=cpu_adam" "states|offload/optimizer=states"; do
      name=${c%%|*}; extra=${c#*|}
      python run_recipe.py --recipe qwen3_30b_a3b_proxy train.global_batch_size=8 \
        train.micro_batch_size=1 train.train_iters=$((end + 1)) $extra output_dir="$WORK/profile-$name" \
        profiling.use_pytorch_profiler=true profiling.profile_step_start=6 profiling.profile_step_end=$end \
        2>&1 | grep -E "error|summary" || true
      cp "$WORK/profile-$name/summary.json" "$OUT/summary-$name.json" || true
      python bench/profile_summary.py "$WORK/profile-$name/profile/rank0.json.gz" > "$OUT/trace-$name.txt"
      grep -A18 "micro-batches" "$OUT/trace-$name.txt"
      if [ -n "${PROFILE_END:-}" ]; then
        sed -n '/^-- annotations/,/^-- cuda runtime by thread/p' "$OUT/trace-$name.txt"
      fi
    done ;;
  profile-threads)  # exact CPU Adam at GBS 4, iterations 9-10 profiled (its GPU share fixed since 6):
    # every thread's CUDA runtime calls, the longest beside what the others did meanwhile
    python run_recipe.py "${PROXY[@]}" offload/optimizer=cpu_adam train.train_iters=11 \
      output_dir="$WORK/profile-threads" profiling.use_pytorch_profiler=true \
      profiling.profile_step_start=9 profiling.profile_step_end=10 > "$OUT/profile-threads.log" 2>&1 || tail -20 "$OUT/profile-threads.log"
    cp "$WORK/profile-threads/summary.json" "$OUT/summary-threads.json" || true
    python bench/profile_summary.py "$WORK/profile-threads/profile/rank0.json.gz" > "$OUT/trace-threads.txt"
    sed -n '/by thread/,$p' "$OUT/trace-threads.txt" ;;
  weight-tests)  # weight offload's gpu tests (6 in parallel), their whole output
    timeout 400 python -m pytest -v -m gpu -k weight tests/test_gpu_training.py -n 6 \
      --basetemp=/tmp/wt -p no:cacheprovider > "$OUT/pytest-gpu-weight-offload.txt" 2>&1 || true
    grep -E "PASSED|FAILED|passed|failed" "$OUT/pytest-gpu-weight-offload.txt" | tail -8 ;;
  weight-offload|weight-offload-caps-proxy|weight-offload-caps|weight-offload-caps-reference)  # weight offload against the
    # same runs without it (dense 8 layers, the proxy); the proxy (llama3_8b) under a 12 (48) GB cap
    python bench/run_benchmarks.py run --suite "$1" --iters 10 --time-limit 560 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  weight-profile)  # weight offload on the proxy, iteration 4 profiled, and its summary.json (what
    # crossed the link each way)
    python run_recipe.py "${PROXY[@]}" offload/optimizer=states offload/weight=enabled \
      model.cpu_offloading_num_layers=4 train.train_iters=5 output_dir="$WORK/profile-weights" \
      profiling.use_pytorch_profiler=true profiling.profile_step_start=4 \
      profiling.profile_step_end=4 > "$OUT/profile-weights.log" 2>&1 || true
    cp "$WORK/profile-weights/summary.json" "$OUT/summary-weights.json" || true
    python bench/profile_summary.py "$WORK/profile-weights/profile/rank0.json.gz" \
      | tee "$OUT/trace-weights.txt" | head -20 ;;
  two-gpu-smoke)  # (two GPUs) both exact host engines on tiny DP2, 4 iterations each: the loop and
    # the engines' facade run before the full model spends minutes
    for e in states cpu_adam; do
      python run_recipe.py --recipe tiny offload/optimizer=$e train.train_iters=4 \
        output_dir="$WORK/smoke-$e" > "$OUT/smoke-$e.log" 2>&1 || { tail -30 "$OUT/smoke-$e.log"; exit 1; }
      grep -E "summary|step_time" "$OUT/smoke-$e.log" | tail -2
    done ;;
  two-gpu-full-1|two-gpu-full-2)  # (two H200) the full Qwen3-30B-A3B, EP2, GBS 8: no offload (-1,
    # oom), offload/optimizer=auto over 22 iterations (-2)
    python bench/run_benchmarks.py run --suite "$1" --iters 22 --time-limit 560 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  two-gpu-engines)  # (two GPUs) the proxy DP2 and EP2: no offload, cpu_adam, states (GBS 8)
    python bench/run_benchmarks.py run --suite two-gpu-engines --iters 10 --time-limit 540 \
      --out "$OUT/results-two-gpu-engines.json" --work-dir "$WORK/bench" ;;
  two-gpu-resume)  # (two GPUs) resume of both exact host engines on DP2 (tiny) and EP2 (tiny_moe)
    timeout 560 python -m pytest -v -s -m gpu -n 4 --basetemp=/tmp/rt -p no:cacheprovider \
      -k "(resume_continues and (states or cpu-adam]) and not 50 and not cp2) or resume_under_expert" \
      tests/test_gpu_training.py > "$OUT/pytest-gpu-resume-2gpu.txt" 2>&1 || true
    grep -E "PASSED|FAILED|ERROR|passed|failed|max" "$OUT/pytest-gpu-resume-2gpu.txt" | tail -12 ;;
  pinning-probe)  # the host engines' start-up: page-locking fresh host arrays, four ways
    timeout 200 python bench/host_pinning_probe.py 2>&1 | tee "$OUT/host-pinning-probe.txt" ;;
  memory-probe)  # the host's memory: the CPU's copies and Adam alone and beside the link's
    OMP_WAIT_POLICY=PASSIVE timeout 200 python bench/host_memory_probe.py 2>&1 | tee "$OUT/host-memory-probe.txt" ;;
  switch-interval)  # cpu_adam at GBS 4 under the stack sampler, then beside no offload at the
    # interpreter's default switch interval (5 ms) and at 0.5 ms: where the CPU part's wall time
    # beyond its Adam goes, and whether the engine's threads wait for the GIL
    one() {  # one NAME [ENV=VALUE ...] [-- OVERRIDES]: a 12-iteration proxy run, its summary's keys
      local name=$1; shift; local envs=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done; shift || true
      env "${envs[@]}" PYTHONPATH="$PWD/bench/sampler:$PYTHONPATH" python run_recipe.py "${PROXY[@]}" \
        train.train_iters=12 "$@" output_dir="$WORK/si-$name" > "$OUT/si-$name.log" 2>&1 || tail -20 "$OUT/si-$name.log"
      cp "$WORK/si-$name/summary.json" "$OUT/summary-si-$name.json" || true
      python - "$name" "$WORK/si-$name/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[2]))
keys = ("step_time_s_median", "fwd_bwd_time_s_median", "optimizer_time_s_median", "cpu_adam_params_on_cpu",
        "cpu_adam_busy_s_median", "cpu_adam_wait_s_median", "cpu_adam_wall_s_median", "cpu_adam_stream_s_median",
        "cpu_adam_gpu_share")
print(sys.argv[1], " ".join(f"{k.replace('_s_median', '').replace('cpu_adam_', '')}={s[k]:.4g}" for k in keys if s.get(k) is not None))
PY
    }
    mkdir -p "$OUT/stacks"
    one sampled SAMPLE_STACKS_OUT="$OUT/stacks" -- offload/optimizer=cpu_adam
    for i in ${ROUNDS:-1}; do
      one base-5ms-$i X=1; one cpu_adam-5ms-$i X=1 -- offload/optimizer=cpu_adam
      one base-0.5ms-$i SWITCH_INTERVAL_S=0.0005; one cpu_adam-0.5ms-$i SWITCH_INTERVAL_S=0.0005 -- offload/optimizer=cpu_adam
    done ;;
  grad-dtype-probe)  # CPU Adam on bf16 gradients (the engines' upcast blocks) against fp32 ones
    OMP_WAIT_POLICY=PASSIVE timeout 300 python bench/grad_dtype_probe.py 2>&1 | tee "$OUT/grad-dtype-probe.txt" ;;
  drift-probe)  # the host alone: one thread's kernel launches and a Python loop, for 4 minutes
    timeout 300 python bench/host_drift_probe.py 2>&1 | tee "$OUT/host-drift-probe.txt" ;;
  cpu-adam-tests-n)  # every CPU-Adam gpu test on one GPU, 8 at a time (the engine's modes, its
    # GPU share, delayed mode, resume, checkpoints moving between engines)
    timeout "${TEST_TIMEOUT:-450}" python -m pytest -v -m gpu -n 8 --basetemp=/tmp/ct \
      -p no:cacheprovider -k "cpu_adam or cpu-adam" tests/test_gpu_training.py \
      > "$OUT/pytest-gpu-cpu-adam-n.txt" 2>&1 || true
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest-gpu-cpu-adam-n.txt" | tail -24 ;;
  gbs-4|gbs-8|gbs-32|gbs-8-pairs|gbs-4-pairs|gbs-4-pairs-2|gbs-32-pairs|gbs-32-pairs-2|gbs-32-pairs-3|gbs-32-pairs-4|share-4|gbs-4-grown|gbs-8-grown|gbs-32-grown|gbs-8-pairs-2|remainders-4|remainders-8|remainders-32|gbs-4-beside|gbs-8-beside|gbs-32-beside)  # exact offload's cost at one global batch, beside no offload (twice)
    python bench/run_benchmarks.py run --suite "$1" --iters 10 --time-limit 560 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  states-tests-n)  # state offload's gpu tests on one GPU, 8 at a time: parity (remainders against
    # the precision-aware baseline, fp32 masters against the plain one), resume, cross-engine
    # checkpoints, weight offload beside it
    timeout "${TEST_TIMEOUT:-450}" python -m pytest -v -m gpu -n 8 --basetemp=/tmp/st \
      -p no:cacheprovider -k "state or states or weight" tests/test_gpu_training.py \
      > "$OUT/pytest-gpu-states-n.txt" 2>&1 || true
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest-gpu-states-n.txt" | tail -24 ;;
  commit-ab)  # SUITE at the sent tree (B) and at commit A_REV (A: its src/ with this bench/), in
    # turn, RUNS (default "b1 a1 b2"; e.g. "b1 a1 b2 a2"), each suite's rows beside each other
    : "${A_REV:?set A_REV}" "${SUITE:=exact-4-ab}"
    A=/tmp/ab-a; rm -rf "$A"; mkdir -p "$A"; git archive "$A_REV" | tar -x -C "$A"; cp -r bench "$A/"
    for run in ${RUNS:-b1 a1 b2}; do
      tree=$PWD rev=$OFFLOAD_RUNNER_COMMIT; [ "${run#a}" != "$run" ] && tree=$A rev=$A_REV
      (cd "$tree" && PYTHONPATH="$tree/src:$PYTHONPATH" OFFLOAD_RUNNER_COMMIT=$rev \
        python bench/run_benchmarks.py run \
        --suite "$SUITE" --iters 10 --work-dir "$WORK/$run" --out "$OUT/results-$SUITE-$run.json")
    done
    python bench/gbs_report.py phases "$OUT"/results-"$SUITE"-*.json ;;
  connections-ab)  # suite exact-4-ab with CUDA_DEVICE_MAX_CONNECTIONS unset (8 hardware queues),
    # at 32, unset again: do the engine's side streams queue behind each other's work?
    for run in default1 max32 default2; do
      (if [ "$run" = max32 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=32; fi
       python bench/run_benchmarks.py run --suite exact-4-ab --iters 10 --work-dir "$WORK/$run" \
         --out "$OUT/results-exact-4-ab-$run.json")
    done ;;
  capacity-auto-37)  # (H200) the largest slice --plan --largest finds for one H200 box, with auto
    python bench/run_benchmarks.py run --suite "$1" --iters 22 --time-limit 560 \
      --out "$OUT/results-$1.json" --work-dir "$WORK/bench" ;;
  llama3-8b-auto)  # (H200) the held-out dense shape with offload/optimizer=auto
    python bench/run_benchmarks.py run --suite llama3-8b-auto --iters 10 --time-limit 560 \
      --out "$OUT/results-llama3-8b-auto.json" --work-dir "$WORK/bench" ;;
  beside-probe)  # state offload at GBS 4: iterations 6-7 profiled (7's forward beside 6's pass:
    # where the host waits), then (BESIDE_QUEUES32 set) 10 iterations with 32 hardware queues
    # (CUDA_DEVICE_MAX_CONNECTIONS: does the compute stream queue behind the pass's stream?),
    # then each BESIDE_RUNS entry ("name|overrides;name|overrides"), 10 iterations each
    IFS=';' read -r -a more <<< "${BESIDE_RUNS:-}"
    for c in "profiled|profiling.use_pytorch_profiler=true profiling.profile_step_start=6 profiling.profile_step_end=7" ${BESIDE_QUEUES32:+"queues32|"} "${more[@]}"; do
      name=${c%%|*}; extra=${c#*|}
      (if [ "$name" = queues32 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=32; fi
       python run_recipe.py "${PROXY[@]}" train.train_iters=10 offload/optimizer=states $extra \
         output_dir="$WORK/beside-$name" 2>&1 | grep -E "error|Error" || true)
      cp "$WORK/beside-$name/summary.json" "$OUT/summary-beside-$name.json" || true
      python -c "import json,sys; m=json.load(open(sys.argv[1])); print(sys.argv[2], {k: round(m[k], 3) for k in ('step_time_s_median', 'fwd_bwd_time_s_median', 'optimizer_time_s_median', 'states_stream_s_median', 'states_beside_forward_s', 'states_forward_wait_s_median')})" "$OUT/summary-beside-$name.json" "$name" || true
    done
    python bench/profile_summary.py "$WORK/beside-profiled/profile/rank0.json.gz" > "$OUT/trace-beside.txt" || true
    head -40 "$OUT/trace-beside.txt"; grep -A12 "micro-batches" "$OUT/trace-beside.txt"
    sed -n '/^-- annotations/,/^-- cuda runtime by thread/p' "$OUT/trace-beside.txt"
    grep -A30 "longest cudaStreamSynchronize" "$OUT/trace-beside.txt" ;;
  copy-queue-probe)  # the training's small copies beside another stream's paced copies, in
    # 128, 16 and 2 MiB chunks, 4 or 1 queued, with or without a kernel after each copy
    # (bench/copy_queue_probe.py), 8 and 32 hardware queues
    for queues in unset 32; do
      (if [ "$queues" = 32 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=32; fi
       timeout 120 python bench/copy_queue_probe.py)
    done 2>&1 | tee "$OUT/copy-queue-probe.txt" ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
