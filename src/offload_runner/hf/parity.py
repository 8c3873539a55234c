"""Our model's logits beside transformers' on the same tokens, one GPU:

    python -m offload_runner.hf.parity CKPT_DIR HF_DIR [KEY=VALUE ...]

CKPT_DIR is any checkpoint of ours with its model.yaml (an import, a saved run); the model is
built as training builds it (the import's recipe, or the checkpoint's architecture on the tiny
recipe, with the overrides given: Transformer Engine, grouped experts, bf16 unless
``mixed_precision.bf16=false``), its weights loaded with ``checkpoint.load_pretrained``. HF_DIR is
loaded with ``AutoModelForCausalLM`` in the same dtype. Prints one JSON line: the largest and the
mean absolute difference of the logits, the mean absolute logit, and how often the top-1 token
agrees. TF32 is off for fp32 comparisons (set NVIDIA_TF32_OVERRIDE=0 for Transformer Engine's
GEMMs before the process starts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BATCH, TOKENS = 4, 128


def _run(ckpt: Path, overrides: list[str]):
    from omegaconf import OmegaConf

    from offload_runner import checkpoint
    from offload_runner.config.compose import compose_config, to_run_config

    root = checkpoint.checkpoint_root(ckpt)
    if (root / "recipe.yaml").is_file():
        cfg = compose_config(
            ["recipe=recipe", *overrides], extra_recipe_dirs=(root / "recipe.yaml",)
        )
    else:
        cfg = compose_config(["recipe=tiny", *overrides])
        cfg = OmegaConf.merge(cfg, {"model": checkpoint.saved_architecture(ckpt)})
    return to_run_config(cfg)


def megatron_logits(ckpt: Path, overrides: list[str], tokens):
    """Logits [batch, tokens, vocab] of our model built for training, weights from ``ckpt``."""
    import torch

    from offload_runner import checkpoint
    from offload_runner.mcore.megatron_config import build_transformer_config
    from offload_runner.mcore.model import build_model
    from offload_runner.train import initialize

    run = _run(ckpt, overrides)
    initialize(run)
    model = build_model(run, build_transformer_config(run.model))
    checkpoint.load_pretrained(ckpt, model)
    model[0].eval()
    positions = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
    with torch.no_grad():
        logits = model[0](tokens, positions, None)
    return logits[..., : run.model.vocab_size].float(), run.model.bf16


def hf_logits(folder: Path, tokens, bf16: bool):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def compare(ckpt: Path, folder: Path, overrides: list[str]) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    tokens = tokens.cuda()
    ours, bf16 = megatron_logits(ckpt, overrides, tokens)
    theirs = hf_logits(folder, tokens, bf16)
    found = {"dtype": "bf16" if bf16 else "fp32", **_differences(ours, theirs)}
    if bf16:  # bf16's own floor: transformers in bf16 against transformers in fp32
        exact = hf_logits(folder, tokens, False)
        found["floor"] = _differences(theirs, exact)
        found["ours_vs_fp32"] = _differences(ours, exact)
    return found


def _differences(ours, theirs) -> dict:
    diff = (ours - theirs).abs()
    return {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "mean_abs_logit": theirs.abs().mean().item(),
        "top1_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        "positions": ours.shape[0] * ours.shape[1],
    }


def run(ckpt: Path, folder: Path, *overrides: str) -> dict:
    """``compare`` in a process of its own, one rank (a test or a bench beside other work)."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env = {**os.environ, **ranks, "MASTER_PORT": str(port), "NVIDIA_TF32_OVERRIDE": "0"}
    command = [sys.executable, "-m", "offload_runner.hf.parity", str(ckpt), str(folder)]
    done = subprocess.run([*command, *overrides], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"hf.parity failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(compare(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])))
