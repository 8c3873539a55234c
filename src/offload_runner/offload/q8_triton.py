"""8-bit moments' quantization and dequantization on the GPU in one Triton kernel each: the same
numbers as quantized.py's torch path (torchao's block scaling, the nearest code of the dynamic
map, ties up), bit for bit (tests/test_quantized_states.py holds them equal on a GPU).

The torch path runs ~10 kernels a moment with full-size temporaries (int64 bucket indices,
gathered fp32 values); a state pass with 8-bit moments moved 7.8G params/s with it, bound by
those kernels rather than by the link (bench/probes/state_pass_probe.py). Here a program reads a
few blocks once, finds each block's absmax, divides by it as torch does (round to nearest), and
finds each value's code by binary search over the map's 255 midpoints.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROWS = 4  # blocks a program takes


@triton.jit
def _quantize(
    x_ptr, codes_ptr, scales_ptr, mid_ptr, blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = rows[:, None] < blocks
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    y = tl.math.div_rn(x, scale[:, None])
    count = tl.zeros([ROWS, BLOCK], dtype=tl.int32)  # midpoints <= y: the code
    for i in tl.static_range(8):
        probe = count + (128 >> i)
        mid = tl.load(mid_ptr + probe - 1, mask=probe <= 255, other=float("inf"))
        count = tl.where(mid <= y, probe, count)
    tl.store(codes_ptr + offs, count.to(tl.uint8), mask=inside)
    tl.store(scales_ptr + rows, scale, mask=rows < blocks)


@triton.jit
def _dequantize(
    codes_ptr, scales_ptr, map_ptr, out_ptr, blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = rows[:, None] < blocks
    codes = tl.load(codes_ptr + offs, mask=inside, other=0).to(tl.int32)
    scale = tl.load(scales_ptr + rows, mask=rows < blocks, other=0.0)
    tl.store(out_ptr + offs, tl.load(map_ptr + codes) * scale[:, None], mask=inside)


def quantize(values, codes, scales, midpoints, block: int) -> None:
    """fp32 ``values`` (whole blocks, contiguous) into ``codes`` and ``scales``."""
    blocks = scales.numel()
    assert values.is_contiguous() and codes.is_contiguous() and values.numel() == blocks * block
    _quantize[(triton.cdiv(blocks, ROWS),)](values, codes, scales, midpoints, blocks, block, ROWS)


def dequantize(codes, scales, qmap, out, block: int) -> None:
    """``codes`` and ``scales`` into fp32 ``out`` (whole blocks, contiguous)."""
    blocks = scales.numel()
    assert out.is_contiguous() and codes.is_contiguous() and out.numel() == blocks * block
    _dequantize[(triton.cdiv(blocks, ROWS),)](codes, scales, qmap, out, blocks, block, ROWS)
