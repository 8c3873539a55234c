"""An fp32 master kept as its bf16 parameter plus a 16-bit remainder, as Megatron-Core's
precision-aware optimizer keeps it (``store_param_remainders``, its default) and Transformer
Engine's Adam kernel updates it (``multi_tensor_adam_param_remainder``).

The master's bits are its parameter's 16 high bits and the remainder's 16 low ones; the parameter
is the master rounded to bf16 by its low half (up where the remainder is negative, i.e. at or
above half an ulp: ties go away from zero, where ``tensor.to(torch.bfloat16)`` goes to even), so
the remainder says how to undo that rounding. The two hold the master exactly: the state window
moves 2 B/param for it instead of 4, and the host keeps 2 B instead of 4.

``split`` and ``rebuild`` are that kernel's two conversions in torch (on any device, in blocks of
host-sized arrays): the window's path without Transformer Engine, checkpoints (which hold fp32
masters), and loads."""

from __future__ import annotations

BLOCK = 1 << 24  # elements converted at a time (the int64 temporaries: 128 MiB each)


def split(master, param, remainder) -> None:
    """``param`` (bf16) and ``remainder`` (int16) from ``master`` (fp32), all of one length."""
    import torch

    for a in range(0, master.numel(), BLOCK):
        b = min(a + BLOCK, master.numel())
        bits = master[a:b].view(torch.int32).long() & 0xFFFFFFFF
        low = bits & 0xFFFF
        high = (bits >> 16) + (low >= 0x8000).long()  # up where the remainder is negative
        remainder[a:b].copy_(_signed(low, 16, torch.int16))
        param[a:b].view(torch.int16).copy_(_signed(high, 16, torch.int16))


def rebuild(param, remainder, out=None):
    """The fp32 master of ``param`` (bf16) and ``remainder`` (int16), in ``out`` where given."""
    import torch

    if out is None:
        out = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    for a in range(0, param.numel(), BLOCK):
        b = min(a + BLOCK, param.numel())
        low = remainder[a:b].long()
        high = param[a:b].view(torch.int16).long() - (low < 0).long()  # undo the rounding up
        bits = ((high & 0xFFFF) << 16) | (low & 0xFFFF)
        out[a:b].view(torch.int32).copy_(_signed(bits, 32, torch.int32))
    return out


def _signed(x, bits: int, dtype):
    """int64 values taken mod 2^bits, as the signed ``dtype`` of the same bits."""
    sign = 1 << (bits - 1)
    return ((x & ((1 << bits) - 1)) ^ sign).sub_(sign).to(dtype)
