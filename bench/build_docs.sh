#!/usr/bin/env bash
# docs/benchmarks/notebook.md (the findings not yet in a topic report of docs/benchmarks) and
# docs/BENCHMARKS.md (the index) from the recorded GPU results (no GPU needed):
#   bash bench/build_docs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
NOTEBOOK=docs/benchmarks/notebook.md
trap 'rm -f $NOTEBOOK.new' EXIT  # a part that failed leaves the last notebook alone
{
  echo "# Lab notebook: findings not yet in a topic report"
  echo
  echo "What the earlier suites found, section by section, as they were written; each moves into"
  echo "a topic report of this folder in turn. A suite's runs in full:"
  echo "\`python bench/run_benchmarks.py report --suite SUITE bench/results/*.json\`."
  echo
  echo "## llama3_8b under a 48 GB cap: its losses beside the same line uncapped"
  echo
  python - <<'PY'
import json, pathlib
def runs(name):
    data = json.loads(pathlib.Path(f"bench/results/results-{name}.json").read_text())
    return data["environment"], {r["case"]["name"]: r["summary"] for r in data["results"]}
env, capped = runs("weight-offload-caps")
ref_env, ref = runs("weight-offload-caps-reference")
a = capped["llama3_8b under 48 GB, weights of 31 layers"]
b = ref["llama3_8b uncapped, no weight offload"]
print(f"Suite `weight-offload-caps` ({env['gpu']}, commit {env['commit']}) trained llama3_8b at seq "
      "8192 under a 48 GB cap with weights of 31 layers, gradients, optimizer state and activations "
      f"offloaded ({a['step_time_s_median']:.1f} s a step, peak {a['gpu_peak_allocated_gb']:.1f} GB); "
      f"suite `weight-offload-caps-reference` ({ref_env['gpu']}, commit {ref_env['commit']}) ran the "
      "same line without the cap and without weight offload, every state on the host "
      f"({b['step_time_s_median']:.1f} s, peak {b['gpu_peak_allocated_gb']:.1f} GB). Their losses "
      "per iteration (the mock data's rise after iteration 5 is the recipe's, in both):")
print()
print("| iteration | " + " | ".join(str(i + 1) for i in range(len(a["losses"]))) + " |")
print("|---|" + "---|" * len(a["losses"]))
for name, s in (("weights offloaded, 48 GB cap", a), ("uncapped, no weight offload", b)):
    print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in s["losses"]) + " |")
PY
  echo
  echo "## The held-out dense shape: llama3_8b at seq 8192, GBS 8, \`offload/optimizer=auto\` (suite \`llama3-8b-auto\`)"
  echo
  python - <<'PY'
import json, pathlib, re
data = json.loads(pathlib.Path("bench/results/results-llama3-8b-auto.json").read_text())
s = data["results"][0]["summary"]
env = data["environment"]
print(f"One H200 ({env['date'][:10]}, commit {env['commit']}): auto chose `{s['auto'].split(' (')[0]}`; "
      f"{s['iterations']} iterations, loss {s['first_loss']:.2f} -> {s['final_loss']:.2f}, step "
      f"{s['step_time_s_median']:.2f} s (forward+backward {s['fwd_bwd_time_s_median']:.2f}, the rest "
      f"{s['optimizer_time_s_median']:.2f}), GPU peak {s['gpu_peak_allocated_gb']:.1f} GB, node RAM "
      f"{s['host_used_gb_max_per_node'][0]:.1f} GB; the engine's CPU Adam ran at "
      f"{s['cpu_adam_params_per_s'] / 1e9:.2f} G/s beside a GPU share that settled at "
      f"{s['cpu_adam_gpu_share']:.2f}. The run planned its update at "
      f"{s['auto'].split('predicted ')[1].split(' per step')[0]} from fused AdamW timed on 16M params,"
      f" which stay in the caches ({re.search(r'at ([0-9.]+) G/s', s['auto'])[1]} G/s there); the"
      " planner now times 64M params "
      "(docs/evidence/fused-adamw-rate-by-size-h200.txt) and prices the engine at its own rates "
      "beside the streams. Planned again that way, at that file's 64M-param rate:")
PY
  echo
  echo '```'
  PYTHONWARNINGS=ignore COLUMNS=400 python run_recipe.py --recipe llama3_8b train.global_batch_size=8 \
    train.micro_batch_size=1 scheduler.lr_warmup_iters=2 planner.gpu_memory_gb=139 \
    planner.host_memory_gb=125 offload/optimizer=auto \
    "planner.cpu_adam_params_per_s=$(awk '/ 64 M/ {print $(NF-1) "e9"}' docs/evidence/fused-adamw-rate-by-size-h200.txt)" \
    --plan 2>&1 | grep -o "^auto: [^;]*; [^;]*; predicted [^:]*" || true
  echo '```'
  echo
  echo "against the measured rest of the step above and its GPU peak (the planner's table below)."
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
  echo "suites \`cpu-adam\` (100%, the hidden fraction, experts only) and \`cpu-adam-sweep\` (25-75%, HDO 50%), one"
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
  echo "### Exact mode's GPU share (suites \`cpu-adam-split-1\`, \`cpu-adam-split-4\`)"
  echo
  echo "Exact CPU Adam moves 4 B/param each way and leaves the link mostly idle, while fused CPU"
  echo "AdamW is bound by the host's memory bandwidth, which the copy engines share. Outside the"
  echo "engine (\`OMP_WAIT_POLICY=PASSIVE python bench/probes/cpu_gpu_split_probe.py\`, one H200,"
  echo "docs/evidence/cpu-gpu-split-probe.txt: 1e9 params, the CPU's share as the engine moves it,"
  echo "the rest's masters and moments through a GPU window of four 64 MiB pieces, both at once):"
  echo
  sed -n 's/^CPU share/- CPU share/p' docs/evidence/cpu-gpu-split-probe.txt
  echo
  echo "So exact mode gives the last pieces in forward order to the GPU over a state window"
  echo "(\`optimizer.cpu_adam_gpu_share\`, balanced each step by default) while the CPU updates the"
  echo "first ones. On the proxy, each suite one call on one H200 (\`bash bench/device_session.sh"
  echo "cpu-adam-split-4\` and \`-1\`), the default against all of Adam on the CPU"
  echo "(\`optimizer.cpu_adam_gpu_share=0\`) and HybridDeviceOptimizer 100% + overlap:"
  echo
  python - <<'PY2'
import json, pathlib
for gbs in (1, 4):
    data = json.loads(pathlib.Path(f"bench/results/results-cpu-adam-split-{gbs}.json").read_text())
    by = {r["case"]["name"]: r["summary"] for r in data["results"]}
    step = lambda name: by[f"GBS{gbs} {name}"]["step_time_s_median"]
    share = by[f"GBS{gbs} cpu_adam 100%"]
    hdo, base = step("HDO 100% + overlap"), step("no offload")
    both, alone = step("cpu_adam 100%"), step("cpu_adam 100%, all on the CPU")
    print(f"- GBS {gbs} (commit {data['environment'].get('commit', '?')}): no offload "
          f"{base * 1000:.0f} ms (repeat {step('no offload (repeat)') * 1000:.0f}); cpu_adam 100% "
          f"with a GPU share of {share['cpu_adam_gpu_share']:.2f} {both * 1000:.0f} ms, all on the "
          f"CPU {alone * 1000:.0f} ms ({alone / both:.2f}x slower); HDO 100% + overlap "
          f"{hdo * 1000:.0f} ms: {hdo / both:.2f}x the GPU share's step, {hdo / alone:.2f}x all on "
          f"the CPU's; peak {share['gpu_peak_allocated_gb']:.2f} GB against HDO's "
          f"{by[f'GBS{gbs} HDO 100% + overlap']['gpu_peak_allocated_gb']:.2f}, page-locked host "
          f"{share['host_pinned_gb_max']:.1f} GB (the moments too) against "
          f"{by[f'GBS{gbs} cpu_adam 100%, all on the CPU']['host_pinned_gb_max']:.1f}")
PY2
  echo
  echo "The split settles where the CPU's share (at the rate it keeps beside the streams) and the"
  echo "window's pass take about as long; the planner prices it the same way"
  echo "(\`step_cost.exact_update_seconds\`, \`hardware.CPU_ADAM_RATE_BESIDE_STREAMS\` from the probe above)."
  echo
  echo "What takes the CPU's rate inside exact mode's update, outside the engine (one H200,"
  echo "\`OMP_WAIT_POLICY=PASSIVE python bench/probes/cpu_adam_copy_probe.py\`,"
  echo "docs/evidence/cpu-adam-copy-probe.txt: 1e9 params in 64 MiB pieces):"
  echo
  grep -E '^[0-9]+ threads' docs/evidence/cpu-adam-copy-probe.txt | sed 's/^/- /'
  echo
  echo "The gradients' copy down costs fused AdamW about a fifth of its rate, the masters' copy up"
  echo "less; a Python thread busy beside it, holding the GIL between its Adam calls, nine tenths."
  echo
  echo "Neither the host pages nor the GIL take the rate inside the engine (two-H200 host, 16"
  echo "threads, \`OMP_WAIT_POLICY=PASSIVE THREADS=16 python bench/probes/cpu_adam_pages_probe.py\`,"
  echo "docs/evidence/cpu-adam-pages-probe.txt: 5e8 params):"
  echo
  grep -E '^(torch|arena|pin_memory)' docs/evidence/cpu-adam-pages-probe.txt | sed 's/^/- /'
  echo
  echo "The engine's arenas (an anonymous mapping, registered with CUDA) run fused AdamW as fast as"
  echo "torch's own allocation, and transparent huge pages add nothing beyond the noise between"
  echo "repeats. Its pieces updated on a worker thread keep their rate beside a thread launching CUDA"
  echo "kernels, as the training thread does (every launch lets the GIL go); only a thread spinning in"
  echo "pure Python takes it (one fused call per 8 pieces recovers little of that). What is left is the"
  echo "host's memory bandwidth: the copy engines read and write the same memory as fused AdamW. With"
  echo "the GPU share, the window's streams take more of it, so the CPU's own calls run at about half"
  echo "their rate alone while the update as a whole (the CPU's pieces and the window's, at once)"
  echo "runs faster than fused AdamW alone on every state; each share run's line in the suite tables"
  echo "gives both (\"the whole update\")."
  echo
  echo "### Delayed mode's GPU share (suite \`cpu-adam-late-share\`)"
  echo
  echo "\`offload/optimizer=cpu_adam_delayed optimizer.cpu_adam_gpu_share=null\`: the last pieces of"
  echo "each step-late update (those the next backward lands last) go through the state window on a"
  echo "side stream under the next forward+backward, their masters, moments and gradients (which"
  echo "went down during the backward) up, masters and moments back, while the CPU updates the rest;"
  echo "the share is balanced each step against the link's whole load (the window's 16 B/param and"
  echo "every piece's landing). Outside the engine first (\`python bench/probes/delayed_share_probe.py\`, one"
  echo "H200, 1e9 params beside bf16 matmuls standing in for forward+backward,"
  echo "docs/evidence/delayed-share-probe.txt):"
  echo
  grep -E '^(CPU alone|GPU share)' docs/evidence/delayed-share-probe.txt | sed 's/^/- /'
  echo
  echo "In the engine, on the proxy, one H200 per suite (\`bash bench/device_session.sh"
  echo "cpu-adam-late-share-1\` and \`-4\`; gpu test docs/evidence/pytest-gpu-cpu-adam-late-share.txt):"
  echo
  python - <<'PY'
import json, pathlib
def rows(path):
    data = json.loads(pathlib.Path(path).read_text())
    return data["environment"]["commit"], {r["case"]["name"]: r["summary"] for r in data["results"]}
for gbs in (1, 4):
    commit, by = rows(f"bench/results/results-cpu-adam-late-share-{gbs}.json")
    base, cpu = by[f"GBS{gbs} no offload"], by[f"GBS{gbs} cpu_adam_delayed 100%"]
    share = by[f"GBS{gbs} cpu_adam_delayed 100%, GPU share"]
    repeat = by[f"GBS{gbs} no offload (repeat)"]
    update = max(share["cpu_adam_wall_s_median"], share["cpu_adam_stream_s_median"])
    print(f"- GBS {gbs} (commit {commit}): no offload {base['step_time_s_median'] * 1000:.0f} ms "
          f"(repeat {repeat['step_time_s_median'] * 1000:.0f}); delayed 100% all on the CPU "
          f"{cpu['step_time_s_median'] * 1000:.0f} ms (its update {cpu['cpu_adam_wall_s_median'] * 1000:.0f} ms, "
          f"forward+backward {cpu['fwd_bwd_time_s_median'] * 1000:.0f}); with the GPU share "
          f"(settled at {share['cpu_adam_gpu_share']:.2f}) {share['step_time_s_median'] * 1000:.0f} ms "
          f"({cpu['step_time_s_median'] / share['step_time_s_median']:.2f}x the all-CPU step's speed; its update "
          f"{update * 1000:.0f} ms, forward+backward {share['fwd_bwd_time_s_median'] * 1000:.0f}); peak "
          f"{share['gpu_peak_allocated_gb']:.2f} GB against {cpu['gpu_peak_allocated_gb']:.2f}")
commit, by = rows("docs/evidence/results-cpu-adam-late-share-1-ce6e28e.json")
cpu, share = by["GBS1 cpu_adam_delayed 100%"], by["GBS1 cpu_adam_delayed 100%, GPU share"]
print(f"- GBS 1 at commit {commit}, its share balanced on the CPU's and the window's rates alone: it "
      f"settled at {share['cpu_adam_gpu_share']:.2f}, the update took "
      f"{max(share['cpu_adam_wall_s_median'], share['cpu_adam_stream_s_median']) * 1000:.0f} ms against "
      f"{cpu['cpu_adam_wall_s_median'] * 1000:.0f} all on the CPU, yet the step "
      f"{share['step_time_s_median'] * 1000:.0f} ms against {cpu['step_time_s_median'] * 1000:.0f}: the next "
      "backward's landings queued behind the window's copies on the link")
PY
  echo
  echo "Where the update outlasts forward+backward several times (GBS 1) the share makes the step"
  echo "faster; where it nearly hides already (GBS 4) forward+backward slowed by more than the"
  echo "shorter update gained, and the step is slower (whether the window's link traffic or the"
  echo "thread issuing its copies takes the time is not measured yet). So"
  echo "delayed mode's preset keeps the share at 0, and \`optimizer.cpu_adam_gpu_share=null\` (or a"
  echo "share) is the setting for small batches. It costs page-locked moments (16 B/param pinned"
  echo "instead of 8) and a window of 4 pieces held through forward+backward; not with weight"
  echo "prediction (validation says so)."
  echo
  echo "### Delayed updates for the routed experts alone (suite \`cpu-adam-experts-ep2\`)"
  echo
  echo "\`offload/optimizer=cpu_adam_delayed_experts\` (\`optimizer.cpu_adam_delayed_scope=experts\`)"
  echo "keeps every Adam state on the host and delays only the routed experts' updates; the dense"
  echo "part and the router update exactly, with the GPU share. Megatron-Core gives the experts an"
  echo "optimizer part of their own only with expert parallelism (at EP=1 their parameters join"
  echo "the dense part), so it needs EP >= 2 and validation says so. On two H200, the proxy at EP2"
  echo "(dense data-parallel 2), GBS 4, one call (\`bash bench/device_session.sh"
  echo "cpu-adam-experts-ep2\`; the gpu test: docs/evidence/pytest-gpu-cpu-adam-delayed-experts-h200x2.txt):"
  echo
  python - <<'PY3'
import json, pathlib
data = json.loads(pathlib.Path("bench/results/results-cpu-adam-experts-ep2.json").read_text())
print(f"Commit {data['environment'].get('commit', '?')}, {data['environment'].get('gpu_count')} x "
      f"{data['environment'].get('gpu')}; the loss is iteration 12's (delayed updates from step 3):")
print()
for r in data["results"]:
    s = r["summary"]
    extra = ""
    if s.get("cpu_offloaded_params"):
        extra = (f", {s['cpu_adam_delayed_params'] / 1e9:.2f}B of its {s['cpu_offloaded_params'] / 1e9:.2f}B "
                 f"offloaded params per rank one step late")
    print(f"- {r['case']['name']}: step {s['step_time_s_median'] * 1000:.0f} ms, peak "
          f"{s['gpu_peak_allocated_gb']:.2f} GB, loss {s['final_loss']:.4f}{extra}")
PY3
  echo
  echo "Over 200 iterations, two seeds, it ends within the baseline's spread across seeds (suite"
  echo "\`cpu-adam-ep2-conv\`, \"Delayed updates of the experts alone\" below). The earlier \"experts only\" runs on one GPU (suites"
  echo "\`cpu-adam-conv-7/8\` and the \`cpu-adam-4\` rows so named) ran at EP=1, where the experts"
  echo "share the dense part: they delayed the first 79.49% of that part in its buffer's"
  echo "(backward-ready) order, the output layer and the last layers, and kept the embedding and the"
  echo "first layers exact on the GPU, not the experts alone."
  echo
  echo "### Exact mode: landing during the next forward (suite \`cpu-adam-landing\`)"
  echo
  echo "\`step()\` hands the update to the CPU and returns; the pieces run in forward order and each"
  echo "module's forward waits for its own parameters (always, where no data-parallel all-gather"
  echo "follows the step: the key that turned it off went after this suite). Against landing within the step, one"
  echo "H200, one call (\`bash bench/device_session.sh cpu-adam-landing\`):"
  echo
  python - <<'PY'
import json, pathlib
data = json.loads(pathlib.Path("bench/results/results-cpu-adam-landing.json").read_text())
steps = {r["case"]["name"]: r["summary"]["step_time_s_median"] * 1000 for r in data["results"]}
for gbs in (4, 1):
    base = steps[f"landing GBS{gbs} no offload"]
    during = steps[f"landing GBS{gbs} cpu_adam 100%, during the forward"]
    within = steps[f"landing GBS{gbs} cpu_adam 100%, within the step"]
    print(f"- GBS {gbs}: no offload {base:.0f} ms; cpu_adam 100% landing during the forward "
          f"{during:.0f} ms, within the step {within:.0f} ms ({within - during:.0f} ms, "
          f"{within / during - 1:.0%} slower; commit {data['environment']['commit']})")
PY
  echo
  echo "### Delayed mode's step boundary"
  echo
  echo "Delayed mode's bound, max(baseline step, CPU Adam), leaves out its copies: this step's"
  echo "gradients down and the last update's masters up, 4 B/param each way at once. At the step"
  echo "boundary (the measured row's \`optimizer.cpu_adam_copy_during_backward=false\`, since removed;"
  echo "and wherever Megatron-Core edits"
  echo "gradients after the backward: data, tensor, pipeline or context parallelism) they wait for"
  echo "\`step()\`; on one GPU they run during the last micro-batch's backward, each piece as soon as"
  echo "its gradients are final, with the CPU applying the clip factor. Each delayed run's rest of the"
  echo "step (after forward+backward) against its baseline's, those copies at 50.8 GB/s each way, and"
  echo "how long \`step()\` waited before the update was handed over:"
  echo
  python - <<'PY'
import json, pathlib
names = ("results-cpu-adam-4.json", "results-cpu-adam-4-delayed.json",
         "results-cpu-adam-4-backward.json", "results-cpu-adam-4-pieces.json")
for name in names:
    data = json.loads((pathlib.Path("bench/results") / name).read_text())
    by_name = {r["case"]["name"]: r["summary"] for r in data["results"] if r["status"] == "ok"}
    base = by_name["GBS4 no offload"]
    for case, s in by_name.items():
        if s.get("cpu_adam_mode") != "delayed":
            continue
        copies = 4 * s["cpu_offloaded_params"] / 50.8e9 * 1000
        rest = s["step_time_s_median"] * 1000 - s["fwd_bwd_time_s_median"] * 1000
        base_rest = (base["step_time_s_median"] - base["fwd_bwd_time_s_median"]) * 1000
        where = ("during the last backward" if s.get("cpu_adam_copies_in_backward")
                 else "at the step boundary")
        waited = s.get("cpu_adam_boundary_s_median")
        print(f"- {case} (`{name}`, commit {data['environment']['commit']}): step "
              f"{s['step_time_s_median'] * 1000:.0f} ms against the baseline's "
              f"{base['step_time_s_median'] * 1000:.0f}; copies {where} ({copies:.0f} ms"
              + (f"; step() waited {waited * 1000:.0f} ms" if waited is not None else "")
              + f"); rest {rest:.0f} ms against the baseline's {base_rest:.0f}; forward+backward "
              f"{s['fwd_bwd_time_s_median'] * 1000:.0f} against {base['fwd_bwd_time_s_median'] * 1000:.0f}; "
              f"CPU Adam {s['cpu_adam_busy_s_median'] * 1000:.0f} ms, the worker's whole update "
              f"{s['cpu_adam_wall_s_median'] * 1000:.0f}")
PY
  echo
  echo "(In \`results-cpu-adam-4-pieces.json\`, commit 224b535, the delayed preset moved 256 MiB pieces:"
  echo "its row \"GBS4 cpu_adam_delayed 100%\" is the 256 MiB one, and the preset went back to 64 MiB"
  echo "after it: 256 MiB pieces were no faster there.)"
  echo
  python - <<'PY'
import json, pathlib
data = json.loads(pathlib.Path("bench/results/results-cpu-adam-4-backward.json").read_text())
s = {r["case"]["name"]: r["summary"] for r in data["results"] if r["status"] == "ok"}
during = s["GBS4 cpu_adam_delayed 100%"]
boundary = s["GBS4 cpu_adam_delayed 100%, copies at the step boundary"]
copies = 4 * during["cpu_offloaded_params"] / 50.8e9 * 1000
print(f"Copying during the backward takes the copies out of `step()`: in `cpu-adam-4-backward` it "
      f"waited {during['cpu_adam_boundary_s_median'] * 1000:.0f} ms instead of "
      f"{boundary['cpu_adam_boundary_s_median'] * 1000:.0f}, and the step fell from "
      f"{boundary['step_time_s_median'] * 1000:.0f} to {during['step_time_s_median'] * 1000:.0f} ms. "
      f"The copies need {copies:.0f} ms at 100%, longer than the last micro-batch's backward at "
      "GBS 4, so a tail remains (`plan.copy_window` counts it, for `--plan`, `auto` and the "
      "hidden fraction).")
PY
  echo
  echo "**The worker's order.** Up to commit 224b535 the worker took a delayed update's pieces in"
  echo "forward order, so it began with the first layers' gradients, the last to come down during the"
  echo "backward, and the next backward's landings (last layers first) waited for the whole update."
  echo "From a9d3268 on it takes them in the order their gradients came down, and \`step()\` crosses"
  echo "the boundary in that order too. The worker's wait for gradients and how far its whole update"
  echo "ran past its Adam calls, delayed 100%, before and after:"
  echo
  python - <<'PY'
import json, pathlib
for name, case in (("results-cpu-adam-4-pieces.json", "GBS4 cpu_adam_delayed 100%, 64 MiB pieces"),
                   ("results-cpu-adam-4-backward.json", "GBS4 cpu_adam_delayed 100%"),
                   ("results-cpu-adam-4.json", "GBS4 cpu_adam_delayed 100%"),
                   ("results-cpu-adam-4-delayed.json", "GBS4 cpu_adam_delayed 100%")):
    data = json.loads((pathlib.Path("bench/results") / name).read_text())
    by = {r["case"]["name"]: r["summary"] for r in data["results"] if r["status"] == "ok"}
    s, base = by[case], by["GBS4 no offload"]
    busy, step = s["cpu_adam_busy_s_median"], s["step_time_s_median"]
    bound = max(base["step_time_s_median"], busy)
    print(f"- `{name}` (commit {data['environment']['commit']}), {case}: waited "
          f"{s['cpu_adam_wait_s_median'] * 1000:.0f} ms for gradients, whole update "
          f"{(s['cpu_adam_wall_s_median'] - busy) * 1000:.0f} ms past its Adam calls; step "
          f"{step * 1000:.0f} ms = {step / bound:.2f}x its bound max({base['step_time_s_median'] * 1000:.0f}, "
          f"{busy * 1000:.0f})")
PY
  echo
  echo "**The training thread's slowdown.** The CPU update slows the kernel-launching training thread"
  echo "during forward+backward (compare each run's forward+backward with its baseline's above: this"
  echo "proxy is bound by that thread). The hidden fraction counts it since dd30334: it keeps that"
  echo "slowdown (\`planner.cpu_adam_launch_slowdown\` seconds per second of CPU Adam beside"
  echo "forward+backward) and the copies' tail within \`planner.delayed_max_overhead\` (10%) of"
  echo "forward+backward without offload. A delayed run given \`planner.forward_backward_s\` measures"
  echo "its own slowdown (\`cpu_adam_launch_slowdown\` in summary.json); the bench does not, because the"
  echo "no-offload run it would compare with drifts over minutes (next list). At the planner's figure:"
  echo
  python - <<'PY'
import json, pathlib
data = json.loads(pathlib.Path("bench/results/results-cpu-adam-4-delayed.json").read_text())
by = {r["case"]["name"]: r for r in data["results"] if r["status"] == "ok"}
full = by["GBS4 cpu_adam_delayed 100%"]["summary"]
hidden = by["GBS4 cpu_adam_delayed at its hidden fraction"]
h = hidden["summary"]
fraction = next(o.split("=")[1] for o in hidden["case"]["overrides"][::-1]
                if o.startswith("optimizer.optimizer_offload_fraction="))
steps = [by[n]["summary"]["step_time_s_median"] for n in ("GBS4 no offload", "GBS4 no offload (repeat)")]
peak = by["GBS4 no offload"]["summary"]["gpu_peak_allocated_gb"]
print(f"- `results-cpu-adam-4-delayed.json` (commit {data['environment']['commit']}): delayed 100% "
      f"reported a hidden fraction of {full['cpu_adam_hidden_fraction']:.3f} (slowdown "
      f"{full['cpu_adam_launch_slowdown']:.2f}, forward+backward without offload taken as "
      f"{full['cpu_adam_forward_backward_without_s'] * 1000:.0f} ms); at {fraction} the step took "
      f"{h['step_time_s_median'] * 1000:.0f} ms = {h['step_time_s_median'] / steps[0]:.2f}x the "
      f"baseline ({h['step_time_s_median'] / steps[1]:.2f}x its repeat), peak "
      f"{h['gpu_peak_allocated_gb']:.2f} GB, {peak - h['gpu_peak_allocated_gb']:.2f} GB below the baseline's")
data = json.loads(pathlib.Path("bench/results/results-cpu-adam-4.json").read_text())
by = {r["case"]["name"]: r for r in data["results"] if r["status"] == "ok"}
full = by["GBS4 cpu_adam_delayed 100%"]
given = [o for o in full["command"] if o.startswith("planner.forward_backward_s=")]
if given:
    h = by["GBS4 cpu_adam_delayed at its hidden fraction"]["summary"]
    peak = by["GBS4 no offload"]["summary"]["gpu_peak_allocated_gb"]
    print(f"- `results-cpu-adam-4.json` (commit {data['environment']['commit']}): the delayed 100% row "
          f"was given its suite's first baseline ({given[0]}) and measured a slowdown of "
          f"{full['summary']['cpu_adam_launch_slowdown']:.2f}, the drift below included: its hidden "
          f"fraction {full['summary']['cpu_adam_hidden_fraction']:.3f} saved "
          f"{peak - h['gpu_peak_allocated_gb']:.2f} GB; the bench has not measured it since")
PY
  echo
  echo "The first no-offload run of a suite against its repeat after the offloaded runs (the same"
  echo "command, minutes apart):"
  echo
  python - <<'PY'
import json, pathlib
files = sorted(pathlib.Path("bench/results").glob("results-cpu-adam-4*.json"))
files += sorted(pathlib.Path("docs/evidence").glob("results-cpu-adam-4-*.json"))
slower = 0
for path in files:
    data = json.loads(path.read_text())
    by = {r["case"]["name"]: r["summary"] for r in data["results"] if r["status"] == "ok"}
    if "GBS4 no offload (repeat)" not in by:
        continue
    a, b = (by[n]["step_time_s_median"] * 1000 for n in ("GBS4 no offload", "GBS4 no offload (repeat)"))
    slower += b > a
    print(f"- `{path.name}` (commit {data['environment']['commit']}): {a:.0f} ms, repeat {b:.0f} ms ({b / a - 1:+.0%})")
    runs = locals().get("runs", 0) + 1
print()
print(f"The repeat ran slower in {slower} of these {runs} suites: the host after minutes of CPU Adam "
      "is not the host before them, so a run mid-suite stands between its two baselines, and a "
      "bar of 1.15x one of them is within this drift.")
PY
  echo
  echo "### Adam kernels against each other (suite \`adam-parity\`)"
  echo
  echo "The tiny recipe, deterministic, 20 iterations: max |Δloss| between every pair of runs"
  echo "(\`bash bench/device_session.sh adam-parity\`):"
  echo
  python - <<'PY'
import json, pathlib
data = json.loads(pathlib.Path("bench/results/results-adam-parity.json").read_text())
losses = {r["case"]["name"]: r["summary"]["losses"] for r in data["results"] if r["status"] == "ok"}
names = list(losses)
print("| | " + " | ".join(names) + " |")
print("|---" * (len(names) + 1) + "|")
for a in names:
    cells = [f"{max(abs(x - y) for x, y in zip(losses[a], losses[b], strict=True)):.2e}" for b in names]
    print(f"| {a} | " + " | ".join(cells) + " |")
gpu = max(abs(x - y) for x, y in zip(*(losses[n] for n in names[:2]), strict=True))
print()
print(f"Two correct GPU kernels, torch's fused AdamW and Transformer Engine's FusedAdam, part the")
print(f"losses by {gpu:.2e} over these 20 iterations: last-bit differences in fp32 flip bf16 roundings")
print("of the weights, and the tiny recipe (lr 1e-3 after 2 warmup iterations) carries them into the")
print("loss. The CPU engine sits at that distance from both GPU kernels and at 0 from")
print("HybridDeviceOptimizer (both run torch's fused AdamW on the CPU), landing during the forward or")
print("within the step alike; its first two losses equal GPU Adam's. A bar of 1e-3 against GPU Adam is")
print(f"below what one GPU Adam kernel keeps against another (commit {data['environment']['commit']}).")
PY
  echo
  echo "### \`cpu-adam-4\` at earlier commits and on other H200s"
  echo
  echo "Earlier runs of the suite, each on its own H200 (docs/evidence/results-cpu-adam-4-<commit>.json;"
  echo "exact mode's engine is the current one from fd1d70e on, delayed mode's worker order changed"
  echo "at a9d3268):"
  echo
  python - <<'PY'
import json, pathlib, sys
sys.path.insert(0, "bench")
from run_benchmarks import _cpu_adam_lines
for path in sorted(pathlib.Path("docs/evidence").glob("results-cpu-adam-4-*.json")):
    data = json.loads(path.read_text())
    env = data["environment"]
    results = [{**r, "environment": env, "source": path.name} for r in data["results"]]
    by_name = {r["case"]["name"]: r for r in results}
    steps = {n: by_name[n]["summary"]["step_time_s_median"] * 1000 for n in
             ("GBS4 no offload", "GBS4 no offload (repeat)", "GBS4 HDO 100% + overlap") if n in by_name}
    rate = env.get("cpu_adam_reference_params_per_s", {}).get("16")
    print(f"`{path.name}` (commit {env['commit']}, {env['date'][:16]}): steps "
          + ", ".join(f"{n.removeprefix('GBS4 ')} {v:.0f} ms" for n, v in steps.items())
          + (f"; torch's fused AdamW alone {rate / 1e9:.2f} G/s on 16 threads" if rate else "") + ":")
    print()
    for line in _cpu_adam_lines(results, by_name)[3:]:
        print(line)
    print()
PY
  echo "The ratio to HDO follows the host: its memory bandwidth sets both CPU Adam's rate and HDO's"
  echo "step, and its single-thread speed the baseline's."
  echo
  echo "Delayed against exact over 200 iterations at GBS 1 (suite \`cpu-adam-long\`; the runs shared"
  echo "their machines with gpu tests, so only their losses count; exact mode ran twice, the spread"
  echo "of one command; delayed mode after 2, 20 and 50 exact steps; \`python"
  echo "bench/plots.py losses docs/evidence/cpu-adam-long.png bench/results/results-cpu-adam-long-*.json\`):"
  echo
  echo "![delayed against exact, 200 iterations](evidence/cpu-adam-long.png)"
  echo
  python - <<'PY'
import pathlib, statistics, sys
sys.path.insert(0, "bench")
from plots import curves
runs = {name: statistics.fmean(losses[-20:])
        for path in sorted(pathlib.Path("bench/results").glob("results-cpu-adam-long-*.json"))
        for name, losses in curves(path)}
for name, final in runs.items():
    print(f"- {name}: mean loss of the last 20 iterations {final:.3f}")
print()
exact = [v for k, v in runs.items() if "delayed" not in k]
print(f"Two runs of the same exact command end {max(exact) - min(exact):.2f} apart here (MoE routing and TE")
print("kernels are not deterministic in these runs, and at GBS 1 the loss falls through a steep phase")
print("whose timing moves); the delayed runs end above both, and a later start of delayed updates does")
print("not help. GBS 1 with a 2-iteration warmup is not where delayed updates are used; the next")
print("section measures them at GBS 4 after a 20-iteration warmup, against seeds.")
PY
  echo
  echo "### Delayed updates at GBS 4, against seeds (suite \`cpu-adam-conv\`)"
  echo
  echo "The proxy at GBS 4 with a 20-iteration warmup, 200 iterations, delayed updates from the end of"
  echo "the warmup (the default), two seeds (weights and data order) of the no-offload baseline and of"
  echo "delayed mode, on two H200 side by side (\`bash bench/device_session.sh cpu-adam-conv-a\` and"
  echo "\`-b\`; the table and the verdict are in the suite's section above). With weight prediction"
  echo "(\`optimizer.cpu_adam_weight_prediction=true\`, \`cpu-adam-conv-c\`, commit 30b0d47) the two runs"
  echo "were stopped by the call's time limit before iteration 200, so they are plotted from their"
  echo "metrics.jsonl (docs/evidence/) and compared at the iterations they reached; their step time"
  echo "mixes prediction's CPU cost with the DP2 tests that shared their cores, so it is no figure of"
  echo "speed. The runs named \"experts only\" (\`optimizer.optimizer_offload_fraction\` at the"
  echo "experts' share of the proxy's parameters, \`cpu-adam-conv-d\`, commit f83189e) ran 200"
  echo "iterations on two H200 side by side, one seed each. They ran at EP=1, where Megatron-Core"
  echo "puts the experts in the dense optimizer part, so they did not delay the experts: they"
  echo "delayed that share of the part in its buffer's backward-ready order (the output layer and"
  echo "the last layers) and kept the embedding and the first layers exact on the GPU."
  echo "\`python bench/plots.py losses docs/evidence/cpu-adam-conv.png"
  echo "bench/results/results-cpu-adam-conv-*.json docs/evidence/cpu-adam-conv-predicting-seed*.jsonl\`:"
  echo
  echo "![delayed updates against seeds, GBS 4](evidence/cpu-adam-conv.png)"
  echo
  python - <<'PY'
import pathlib, statistics, sys
sys.path.insert(0, "bench")
from plots import curves
files = [*sorted(pathlib.Path("bench/results").glob("results-cpu-adam-conv-*.json")),
         *sorted(pathlib.Path("docs/evidence").glob("cpu-adam-conv-predicting-seed*.jsonl"))]
runs = {name: losses for path in files for name, losses in curves(path)}

def reached(losses, level=0.1, window=20):
    """The first iteration whose trailing 20-iteration mean is below ``level``."""
    for i in range(window, len(losses) + 1):
        if statistics.fmean(losses[i - window:i]) < level:
            return i
    return None

print("| run | iterations | first 20-iteration mean below 0.1 at | mean of iterations 141-160 |")
print("|---|---|---|---|")
for name, losses in runs.items():
    late = statistics.fmean(losses[140:160])
    print(f"| {name} | {len(losses)} | {reached(losses)} | {late:.3f} |")
print()
base = [v for k, v in runs.items() if "no offload" in k]
delayed = [v for k, v in runs.items() if k.startswith("conv cpu_adam_delayed seed")]
predicting = [v for k, v in runs.items() if "predicting" in k]
experts = [v for k, v in runs.items() if "experts only" in k]
mean = lambda group: statistics.fmean(reached(v) for v in group)
print(f"Delayed updates of every parameter reach the 0.1 level {mean(delayed) - mean(base):.0f} iterations "
      f"after the baseline (mean over seeds), with weight prediction {mean(predicting) - mean(base):.0f}, "
      f"for the \"experts only\" runs (the embedding and first layers exact) {mean(experts) - mean(base):.0f}.")
print("All runs end near zero loss (the mock data's next-token rule is learned). Delayed updates of")
print("every parameter end outside the baseline's spread across seeds: they are slower where the loss")
print("falls fastest. The \"experts only\" runs, which kept the embedding and the first layers exact,")
print("end within it (the verdict per configuration is in the suite's section above). The experts")
print("alone delayed (offload/optimizer=cpu_adam_delayed_experts, with expert parallelism) are the")
print("next section. On a toy transformer on the CPU (`python bench/probes/delayed_update_toy.py`,")
print("docs/evidence/delayed-update-toy.txt) one update of staleness costs less and prediction recovers")
print("exact mode's curve; on the MoE proxy prediction recovers part of the lag.")
PY
  echo
  echo "### Delayed updates of the experts alone, EP2 (suite \`cpu-adam-ep2-conv\`)"
  echo
  echo "\`offload/optimizer=cpu_adam_delayed_experts\` (every Adam state on the host, the routed experts'"
  echo "update one step late, the dense part's exact) against the no-offload baseline, the proxy on two"
  echo "H200 at EP2, GBS 4, a 20-iteration warmup, 200 iterations, two seeds; exact mode"
  echo "(\`offload/optimizer=cpu_adam\`) beside them on the first seed (\`bash bench/device_session.sh"
  echo "cpu-adam-ep2-conv-1\`, \`-2\`, \`-3\`, one call each). \`python bench/plots.py losses"
  echo "docs/evidence/cpu-adam-ep2-conv.png bench/results/results-cpu-adam-ep2-conv-*.json\`:"
  echo
  echo "![the experts' updates delayed against seeds, EP2, GBS 4](evidence/cpu-adam-ep2-conv.png)"
  echo
  python - <<'PY'
import json, pathlib, sys
sys.path.insert(0, "bench")
from run_benchmarks import convergence, tail_mean, CONVERGENCE_TAIL
results = [r for path in sorted(pathlib.Path("bench/results").glob("results-cpu-adam-ep2-conv-*.json"))
           for r in json.loads(path.read_text())["results"]]
found = convergence(results)
print("| run | step ms | delayed params per rank | offloaded params per rank | final loss (mean of the "
      f"last {CONVERGENCE_TAIL}) |")
print("|---|---|---|---|---|")
for r in results:
    s = r["summary"]
    delayed, offloaded = s.get("cpu_adam_delayed_params"), s.get("cpu_offloaded_params")
    print(f"| {r['case']['name']} | {s['step_time_s_median'] * 1000:.0f} | "
          f"{f'{delayed / 1e9:.2f}B' if delayed else '-'} | {f'{offloaded / 1e9:.2f}B' if offloaded else '-'} | "
          f"{tail_mean(s['losses']):.4f} |")
print()
for name, row in found["runs"].items():
    verdict = "within" if row["within_noise"] else "outside"
    print(f"- {name}: mean final loss {row['gap']:+.4f} against the baseline's, {verdict} its spread "
          f"across seeds ({found['spread']:.4f})")
print()
print("The dense layers and the router updating exactly is what keeps delayed updates within the")
print("seeds' noise here, as the one-GPU runs that kept the embedding and first layers exact did; delayed")
print("updates of every parameter ended outside it (suite `cpu-adam-conv`). Step times here are of runs")
print("whose losses are the point; their speed against bounds is in suite `cpu-adam-experts-ep2`.")
PY
  echo
} > $NOTEBOOK.new
mv $NOTEBOOK.new $NOTEBOOK
python bench/run_benchmarks.py report bench/results/*.json > docs/BENCHMARKS.md
