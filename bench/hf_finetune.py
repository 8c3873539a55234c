#!/usr/bin/env python
"""Suite ``hf-finetune`` (one GPU): a Hugging Face checkpoint of the proxy in, fine-tuned on chat
data, out again, and transformers' forward of the export beside ours.

    python bench/hf_finetune.py --out bench/results/results-hf-finetune-r1.json --work /tmp/hf

1. transformers' Qwen3MoeForCausalLM at the proxy's shape (4 layers at full width, random
   weights), saved in bf16 with the chat tokenizer (tests/data/chat_tokenizer);
2. ``--import-hf`` (its time and peak host RAM, as the command prints them);
3. ``--prepare`` of the chat sample with the import's tokenizer;
4. two fine-tunes of the import's recipe side by side on the GPU (their finding is the loss on
   the answers, not the time): ``offload/optimizer=auto``, and state offload with 8-bit moments;
   weights saved without the optimizer;
5. ``--export-hf`` of the first (time, peak host RAM), and hf/parity.py: our model from the saved
   weights against transformers' forward of the export.
Each step's result is written to --out as it finishes. Its report, the words of
templates/hf-finetune.md with the figures of its results file:

    python bench/hf_finetune.py report > docs/benchmarks/hf-finetune.md
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from fill import SHARED_PARTS, fill
from run_benchmarks import environment, run_case
from suites import Case

ROOT = Path(__file__).resolve().parents[1]
# the fine-tunes' overrides (the two runs share the machine and the card)
TRAIN = [
    "model.seq_length=1024",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
    "scheduler.lr_warmup_iters=5",
    "optimizer.lr=1e-4",
    "validation.eval_interval=10",
    "validation.eval_iters=2",
    "planner.host_memory_gb=60",
    "checkpoint.save_optim=false",
]
ENGINES = {  # row: its overrides (auto on 48 GB picks an offload), its save folder
    "auto": ("offload/optimizer=auto planner.gpu_memory_gb=48", "save-auto"),
    "states + 8-bit moments": (
        "offload/optimizer=states optimizer.exp_avg_dtype=q8 optimizer.exp_avg_sq_dtype=q8 "
        "planner.gpu_memory_gb=64",
        "save-states",
    ),
}
PEAK = re.compile(r"peak host RAM ([\d.]+) GB")


def cli(*args: str) -> dict:
    """run_recipe.py with ``args``: its wall time, its last line, the peak RAM it printed."""
    began = time.perf_counter()
    command = [sys.executable, str(ROOT / "run_recipe.py"), *args]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    line = done.stdout.strip().splitlines()[-1]
    peak = PEAK.search(line)
    took = time.perf_counter() - began
    return {
        "command": command[1:],
        "wall_s": took,
        "said": line,
        "peak_host_gb": peak and float(peak[1]),
    }


def make_source(folder: Path) -> dict:
    """The proxy recipe's model as transformers' Qwen3-MoE, random, bf16, with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from offload_runner.config.compose import compose_config, to_run_config
    from offload_runner.hf.families import FAMILIES, hf_config

    model = to_run_config(compose_config(["recipe=qwen3_30b_a3b_proxy"])).model
    config = hf_config(FAMILIES["qwen3_moe"], model, "bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((ROOT / "tests/data/chat_tokenizer" / name).read_bytes())
    return {"bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors"))}


def main() -> int:
    from offload_runner.hf.parity import run as parity

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    work = args.work
    saved = {"suite": "hf-finetune", "environment": environment(), "iters": args.iters}

    def record(key: str, value) -> None:
        saved[key] = value
        Path(args.out).write_text(json.dumps(saved, indent=1))

    record("source", make_source(work / "hf"))
    record("import", cli("--import-hf", str(work / "hf"), "--output", str(work / "ckpt")))
    chat = (str(ROOT / "tests/data/chat/sotu_chat.jsonl"), "--output", str(work / "chat"))
    record("prepare", cli("--prepare", *chat, "--tokenizer", str(work / "ckpt/hf")))
    data = f"dataset.data_path=[{work / 'chat'}]"
    cases = [
        Case(
            name, str(work / "ckpt/recipe.yaml"), (*TRAIN, data, f"checkpoint.save={work / d}", *o)
        )
        for name, (o, d) in ENGINES.items()
    ]
    with ThreadPoolExecutor(len(cases)) as pool:  # their losses count, not their times
        runs = pool.map(lambda c: asdict(run_case(c, work / "runs", args.iters)), cases)
        record("results", list(runs))
    record("export", cli("--export-hf", str(work / "save-auto"), "--output", str(work / "out")))
    record("parity", parity(work / "save-auto", work / "out"))
    return 0


if __name__ == "__main__":
    sys.exit(print(fill("hf-finetune.md", SHARED_PARTS)) if sys.argv[1:] == ["report"] else main())
