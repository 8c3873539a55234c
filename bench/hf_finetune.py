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
Each step's result is written to --out as it finishes.
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

from run_benchmarks import environment, run_case
from suites import Case

ROOT = Path(__file__).resolve().parents[1]
PROXY = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    tie_word_embeddings=False,
)
TRAIN = (
    "model.seq_length=1024",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
    "scheduler.lr_warmup_iters=5",
    "optimizer.lr=1e-4",
    "validation.eval_interval=10",
    "validation.eval_iters=2",
    "planner.host_memory_gb=60",  # two runs share the machine and the card
    "checkpoint.save_optim=false",
)
ENGINES = {
    "auto": ("offload/optimizer=auto", "planner.gpu_memory_gb=48"),  # picks an offload
    "states + 8-bit moments": (
        "planner.gpu_memory_gb=64",
        "offload/optimizer=states",
        "optimizer.exp_avg_dtype=q8",
        "optimizer.exp_avg_sq_dtype=q8",
    ),
}
PEAK = re.compile(r"peak host RAM ([\d.]+) GB")


def cli(*args: str) -> dict:
    """run_recipe.py with ``args``: its wall time, its last line, the peak RAM it printed."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(ROOT / "run_recipe.py"), *args], capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"{args[0]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    line = done.stdout.strip().splitlines()[-1]
    peak = PEAK.search(line)
    return {
        "command": ["python", "run_recipe.py", *args],
        "wall_s": time.perf_counter() - began,
        "said": line,
        "peak_host_gb": float(peak.group(1)) if peak else None,
    }


def make_source(folder: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    began = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**PROXY), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((ROOT / "tests/data/chat_tokenizer" / name).read_bytes())
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "bytes": size, "wall_s": time.perf_counter() - began}


def losses(run_dir: Path) -> list[list[float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [[r["iteration"], r["loss"]] for r in rows if "loss" in r and "iteration" in r]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    work = Path(args.work)
    saved = {"suite": "hf-finetune", "environment": environment(), "iters": args.iters}

    def record(key: str, value) -> None:
        saved[key] = value
        Path(args.out).write_text(json.dumps(saved, indent=1))
        print(key, json.dumps(value)[:400], flush=True)

    record("source", make_source(work / "hf"))
    record("import", cli("--import-hf", str(work / "hf"), "--output", str(work / "ckpt")))
    chat = ["--prepare", str(ROOT / "tests/data/chat/sotu_chat.jsonl")]
    record(
        "prepare", cli(*chat, "--output", str(work / "chat"), "--tokenizer", str(work / "ckpt/hf"))
    )
    recipe = str(work / "ckpt/recipe.yaml")
    cases = [
        Case(
            name,
            recipe,
            (
                *TRAIN,
                f"dataset.data_path=[{work / 'chat'}]",
                f"checkpoint.save={work / slug}",
                *extra,
            ),
        )
        for (name, extra), slug in zip(ENGINES.items(), ("save-auto", "save-states"), strict=True)
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = list(pool.map(lambda c: run_case(c, work / "runs", args.iters), cases))
    results = [
        asdict(r) | {"losses": losses(work / "runs" / c.slug)}
        for r, c in zip(runs, cases, strict=True)
    ]
    record("results", results)
    record("export", cli("--export-hf", str(work / "save-auto"), "--output", str(work / "out")))
    record("parity", parity(work / "save-auto", work / "out"))
    return 0


def parity(ckpt: Path, folder: Path) -> dict:
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}",
    }
    command = [sys.executable, "-m", "offload_runner.hf.parity", str(ckpt), str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        return {"failed": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
