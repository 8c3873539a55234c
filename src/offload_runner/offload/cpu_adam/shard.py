"""What the CPU-Adam engine's parts (``Link``, ``Share``, ``Delay``) read of its shard, and all
they read of the engine: the device, the host arrays, the pieces and the updates so far. The
engine fills it as it goes; the parts never see the engine itself."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Shard:
    """One engine's shard as its parts see it. The host arrays are set once allocated (``guess``
    only with weight prediction), ``pieces`` once planned (in the order they move), and
    ``history`` holds the updates done (the GPU share's balance reads the last)."""

    device: object
    on_cuda: bool
    numel: int  # offloaded elements, the host arrays' length
    chunk_numel: int  # the longest piece
    grad: object = None
    master: object = None
    exp_avg: object = None
    exp_avg_sq: object = None
    guess: object = None
    pieces: list | None = None
    history: list = field(default_factory=list)
