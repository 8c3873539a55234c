"""The state engine's two lowest precision steps, both through torchao's optimizer helpers.

- **8-bit moments** (``optimizer.exp_avg_dtype=q8 optimizer.exp_avg_sq_dtype=q8``): each block of
  ``BLOCK`` elements of a moment is kept as uint8 codes into the dynamic quantization map of
  bitsandbytes' 8-bit Adam (signed for exp_avg, unsigned for exp_avg_sq) and the block's absmax
  as an fp32 scale: 1 B + 4 / BLOCK B per element on the host and on the link, fp32 for the math
  in the window. torchao's ``optim.quant_utils`` gives the map, the block scaling and the
  dequantization (its Adam8bit's own functions, block-wise with per-block scales: the published
  form, not a per-tensor FP8 scale); the nearest code is ``torch.bucketize``'s (``quantize``).
- **bf16 masters** (``optimizer.main_params_dtype=bf16``): no master on the host; Adam updates the
  bf16 parameter upcast to fp32 and rounds it back stochastically (torchao's
  ``_fp32_to_bf16_sr``, on the engine's own generator), so updates smaller than half a bf16 ulp
  still move it on average.
"""

from __future__ import annotations

import functools
import logging

BLOCK = 256  # elements per scale (torchao's and bitsandbytes' default block)


@functools.cache
def _quant_utils():
    """torchao.optim.quant_utils, imported without the warnings torchao's package import logs
    where its C++ extensions do not match the installed torch (the helpers here are plain
    torch)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.optim import quant_utils
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return quant_utils


@functools.cache
def qmap(signed: bool, device):
    """The 256 values a code stands for (bitsandbytes' dynamic map), on ``device``."""
    import torch

    values = _quant_utils().create_dynamic_map(signed=signed)
    return torch.tensor(values, dtype=torch.float32, device=device)


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


@functools.cache
def midpoints(signed: bool, device):
    """Half-way between neighbouring map values: a value's nearest code is where it falls."""
    values = qmap(signed, device)
    return (values[1:] + values[:-1]) / 2


@functools.cache
def _fused():
    """q8_triton, where Triton is installed (it comes with torch's CUDA wheels), else None."""
    try:
        from offload_runner.offload import q8_triton
    except ImportError:
        return None
    return q8_triton


def quantize(values, codes, scales, signed: bool) -> None:
    """fp32 ``values`` (a multiple of BLOCK long) into uint8 ``codes`` and fp32 ``scales``: each
    block scaled by its absmax (torchao's ``scale_tensor``), then the nearest code, ties up. That
    is torchao's ``quantize_8bit_with_qmap`` (a test holds the codes equal); its branchless
    binary search runs ~50 kernels a call, ``torch.bucketize`` over the map's midpoints one
    (4.7x faster on this project's 2-core CI machine, 1M elements). On the GPU, one Triton
    kernel (q8_triton.py) gives the same codes."""
    import torch

    if values.is_cuda and (fused := _fused()) is not None:
        fused.quantize(values, codes, scales, midpoints(signed, values.device), BLOCK)
        return
    scaled, scale = _quant_utils().scale_tensor(values, BLOCK)
    codes.copy_(torch.bucketize(scaled, midpoints(signed, values.device), right=True))
    scales.copy_(scale)


def dequantize(codes, scales, out, signed: bool) -> None:
    """uint8 ``codes`` and fp32 ``scales`` into fp32 ``out`` (a multiple of BLOCK long)."""
    if codes.is_cuda and (fused := _fused()) is not None:
        fused.dequantize(codes, scales, qmap(signed, codes.device), out, BLOCK)
        return
    out.copy_(_quant_utils().dequant_with_qmap(codes, qmap(signed, codes.device), scales))


def round_stochastically(master, param, generator) -> None:
    """fp32 ``master`` into bf16 ``param``: away from zero with the probability of what bf16
    drops. torchao's ``_fp32_to_bf16_sr``, drawing from ``generator`` (it takes none): the
    passes run on a side thread beside the forward, whose kernels draw from the default
    generator too, so a shared one gave each run its own interleaving (a resumed run's losses
    moved 2.5e-3 from the uninterrupted run's on an H200); an engine's own is saved with it."""
    import torch

    bits = master.view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, device=bits.device, dtype=torch.int32, generator=generator
    )
    toward_zero = bits & 0xFFFF0000
    rounded = torch.where(noise < (bits & 0xFFFF), toward_zero + 0x10000, toward_zero)
    param.copy_(rounded.view(torch.float32))
