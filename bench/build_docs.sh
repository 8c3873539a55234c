#!/usr/bin/env bash
# docs/BENCHMARKS.md from the recorded GPU results (no GPU needed):
#   bash bench/build_docs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
{
  python bench/run_benchmarks.py report bench/results/*.json
  echo "## Memory planner against the measured peaks"
  echo
  echo "Every run above, planned from its own command line by \`--plan\` arithmetic"
  echo "(\`python bench/calibrate_planner.py bench/results/*.json\`; tests/test_plan.py holds the"
  echo "error under 10%). GB are GiB."
  echo
  python bench/calibrate_planner.py bench/results/*.json
  echo
  echo "## Sweep: HybridDeviceOptimizer fraction on the Qwen3-30B-A3B proxy (one H200)"
  echo
  echo "\`python run_recipe.py -m --recipe qwen3_30b_a3b_proxy train.global_batch_size=4"
  echo "train.micro_batch_size=1 train.train_iters=10 optimizer.optimizer_cpu_offload=true"
  echo "optimizer.optimizer_offload_fraction=0,0.25,0.5,0.75,1.0\`, then"
  echo "\`python run_recipe.py --collect <sweep dir>\` (bench/device_session.sh sweep, commit 5bd2591,"
  echo "megatron-core 0.19.2, TE 2.20.2, torch 2.11.0+cu130)."
  echo
  tail -n +3 docs/evidence/sweep.md
  echo
  echo "![step time and peak memory against the offload fraction](evidence/sweep.png)"
  echo
  echo "## CPU-Adam engine: fraction sweep, long run, and why the proxy's step time wanders"
  echo
  echo "Slowdown and peak GPU memory against \`optimizer.optimizer_offload_fraction\` at GBS 4, from"
  echo "suites \`cpu-adam\` (100%, delayed 25% and 40%) and \`cpu-adam-sweep\` (25-75%, HDO 50%), one"
  echo "H200 (\`python bench/plots.py sweep docs/evidence/cpu-adam-sweep.png"
  echo "bench/results/results-cpu-adam-4.json bench/results/results-cpu-adam-sweep.json\`):"
  echo
  echo "![CPU-Adam fraction sweep](evidence/cpu-adam-sweep.png)"
  echo
  echo "Each point is set against its own suite's no-offload run, and those differ: the proxy at"
  echo "micro-batch 1 is bound by the Python thread that launches its kernels, not by the GPU. A"
  echo "profile of two GBS 4 iterations (\`bash bench/device_session.sh profile-4\`,"
  echo "\`profiling.use_pytorch_profiler=true\`, summarized by bench/profile_summary.py) shows"
  echo "$(grep -o 'kernels busy [^,]*' docs/evidence/profile-gbs4-baseline.txt) of the window without"
  echo "offload (evidence/profile-gbs4-baseline.txt; TE's grouped expert linears take milliseconds of"
  echo "CPU per call; with cpu_adam: evidence/profile-gbs4-cpu-adam.txt). So forward+backward follows"
  echo "the host's state, and the same no-offload command measured on the same day:"
  echo
  python - <<'PY'
import json, pathlib
for path in sorted(pathlib.Path("bench/results").glob("results-*.json")):
    data = json.loads(path.read_text())
    for r in data["results"]:
        if r["case"]["name"].endswith("GBS4 no offload") and r["case"].get("nproc", 1) == 1:
            s = r["summary"]
            print(f"- `{path.name}` ({data['environment']['date'][:16]}): step "
                  f"{s['step_time_s_median'] * 1000:.0f} ms, forward+backward "
                  f"{s['fwd_bwd_time_s_median'] * 1000:.0f} ms")
PY
  echo
  echo "A bar that is a ratio to one baseline run inherits that spread; compare rows of one suite."
  echo
  echo "Delayed against exact over 200 iterations at GBS 1 (suite \`cpu-adam-long\`; the two runs"
  echo "shared their machines with gpu tests, so only their losses count; \`python"
  echo "bench/plots.py losses docs/evidence/cpu-adam-long.png bench/results/results-cpu-adam-long-*.json\`):"
  echo
  echo "![delayed against exact, 200 iterations](evidence/cpu-adam-long.png)"
  echo
  python - <<'PY'
import json, pathlib
runs = {}
for path in sorted(pathlib.Path("bench/results").glob("results-cpu-adam-long-*.json")):
    for r in json.loads(path.read_text())["results"]:
        runs[r["case"]["name"]] = r["summary"]["losses"]
for name, losses in runs.items():
    print(f"- {name}: mean loss of the last 20 iterations {sum(losses[-20:]) / 20:.3f}")
PY
  echo
  echo "With two exact steps (the proxy's LR warmup) before the one-step-stale updates begin, the"
  echo "delayed run falls behind at GBS 1 and does not catch up within 200 iterations."
  echo
  echo "## Checkpoint resume and the gpu-marked tests"
  echo
  echo "\`python -m pytest -m gpu tests/\` (tests/test_gpu_training.py, tiny recipe in deterministic"
  echo "mode: same seed twice, activation and state offload against the baseline, and resume: 8"
  echo "iterations against 4 + 4 resumed from a checkpoint, the resumed losses within 1e-3 of the"
  echo "uninterrupted run's, for GPU Adam, optimizer-state offload and HybridDeviceOptimizer 50%)."
  echo "On two GPUs torchrun starts one rank per GPU (data parallel). pytest-gpu-cp-h200x2.txt"
  echo "(\`bash bench/device_session.sh cp-tests\`, commit 4b765b6) adds context parallelism: the"
  echo "loss and gradient arithmetic on two gloo ranks (megatron-core 0.19.2's batch split), the"
  echo "same seed twice on DP2, CP2 against DP2 on the same global batch (max |Δloss| below,"
  echo "the test wants under 1e-2), and resume under CP2 with the optimizer states offloaded."
  echo "Last lines of each log:"
  echo
  for f in docs/evidence/pytest-gpu*.txt; do
    echo "- \`${f#docs/}\`: $(grep -E '^(FAILED|CP2 vs DP2|[0-9]+ (passed|failed))' "$f" | tr '\n' ';' | sed 's/;$//; s/;/; /g')"
  done
  echo
  echo "The CPU-Adam engine's gpu tests (\`bash bench/device_session.sh cpu-adam-tests\`): on one H200,"
  echo "pytest-gpu-cpu-adam-h200.txt (tree of e6974ad) and pytest-gpu-cpu-adam-2-h200.txt (51f2640):"
  echo "resume of cpu_adam, cpu_adam_delayed and cpu_adam at 50% passed; delayed mode passed. On two"
  echo "H200 (\`cpu-adam-dp2-tests\`, tree of f31806b, DP2), pytest-gpu-cpu-adam-dp2-h200x2.txt: exact"
  echo "mode gives HybridDeviceOptimizer 100%'s losses exactly (both run torch's fused AdamW) and the"
  echo "same distance from GPU Adam (Transformer Engine's FusedAdam), delayed mode lands one step late,"
  echo "cpu_adam resumes; the call's time ran out before the other resume tests and the checkpoint"
  echo "exchange with HybridDeviceOptimizer (test_checkpoint_moves_between_hybrid_and_cpu_adam, not"
  echo "yet run on a GPU)."
  echo
  echo "pytest-gpu-h200.txt is every gpu-marked test on one H200 at commit 2bdfa10"
  echo "(\`bash bench/device_session.sh tests\`; the two-GPU tests skip there). The resume logs are"
  echo "commit 69aa678, after a324fad restored HybridDeviceOptimizer resume (its CPU AdamW step"
  echo "counter had come back as 1)."
  echo
  echo "## Verify reports"
  echo
  echo "\`python run_recipe.py --recipe qwen3_30b_a3b_proxy train.global_batch_size=4"
  echo "train.micro_batch_size=1 offload/optimizer=cpu_50 verify.repeat_baseline=true --verify\` and"
  echo "\`python run_recipe.py --recipe tiny offload/optimizer=states --verify\` (one H200, commit 5bd2591):"
  echo
  for f in docs/evidence/verify-*.md; do sed 's/^# /### /' "$f"; echo; done
} > docs/BENCHMARKS.md
