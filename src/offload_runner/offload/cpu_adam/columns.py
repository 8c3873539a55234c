"""Delayed mode's exact columns (``optimizer.cpu_adam_exact_columns``, ZenFlow's selective
update): in each 2-D weight the columns whose gradients weigh most are updated on the GPU at
every step, exactly, while the CPU takes every element one step late as before.

Columns, not rows: a linear layer's weight is [out, in] and its gradient sums ``delta x^T`` over
tokens, so a column's gradient scales with its input feature, and a transformer's hidden states
carry a few features far larger than the rest at every token and step: the gradient's mass sits
in few columns, and in the same ones step after step (ZenFlow's spatial and temporal locality;
its selection ranks columns too). Megatron-Core's layouts keep every linear weight as [out, in]
(fused QKV and each expert's weight alike); a column is strided there, which the GPU's gathers
do not mind, and the host only gathers at a selection.

What each side holds: the host arrays keep every element's master and moments, updated by the
CPU one step late, the selected ones included (their gradients are the same, so are their
moments; the CPU's masters of those columns land and are overwritten by the GPU's before any
forward reads them). The GPU keeps the selected columns' masters and moments (in the host
arrays' dtypes) and updates them right after Megatron-Core's clipping, on the clipped
gradients: the global norm saw every gradient once, in the one gradient buffer. A selection
(at the first delayed step and every SELECT_EVERY steps after, by the step's summed |gradient|
per column) first writes the leaving columns' GPU state back into the host arrays, whose
CPU copies are then current again, and takes the entering ones' state from there, once the
CPU's last update is done. A checkpoint does the same write-back and keeps the selection in the
param groups: a resumed run continues bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload_runner.offload.cpu_adam.shard import Shard
from offload_runner.offload.host_adam import adamw, holders

SELECT_EVERY = 100  # delayed steps between selections
COLUMNS = "cpu_adam_exact_columns"  # param-group key: each block's selected columns, for a resume


@dataclass
class Block:
    """The whole rows of a 2-D weight that one shard parameter holds: ``rows`` x ``width``
    elements from ``start`` in the host arrays (``offset`` into the shard parameter), their
    selected columns and the GPU's state of those."""

    param: object  # the shard parameter (1-D, a view of the parameter buffer)
    group: int
    start: int
    offset: int
    rows: int
    width: int
    index: object = None  # the selected columns, ascending, on the device
    master: object = None  # [rows, k] on the device
    exp_avg: object = None
    exp_avg_sq: object = None

    def of(self, flat):
        """This block's [rows, width] view of a flat array laid out as the host arrays."""
        return flat[self.start : self.start + self.rows * self.width].view(self.rows, self.width)

    def in_param(self, flat):
        """This block's [rows, width] view of the shard parameter's (or its gradient's) elements."""
        n = self.rows * self.width
        return flat[self.offset : self.offset + n].view(self.rows, self.width)


def blocks_of(shards: list, model_params: list, fraction: float, flat_start) -> list[Block]:
    """A block for each shard ``(group, param)`` holding whole rows of a 2-D model parameter at
    least 1 / ``fraction`` columns wide (``flat_start(param)``: where its elements start in the
    host arrays)."""
    found = holders([p for _, p in shards], model_params)
    blocks = []
    for gi, p in shards:
        q, at = found.get(id(p), (None, 0))  # p's first element within q
        if q is None or q.dim() != 2 or q.shape[1] * fraction < 1:
            continue
        width = q.shape[1]
        first = -(-at // width)  # its first whole row
        rows = (at + p.numel()) // width - first
        if rows > 0:
            offset = first * width - at
            blocks.append(Block(p, gi, flat_start(p) + offset, offset, rows, width))
    return blocks


class ExactColumns:
    """A CpuAdam's exact columns in delayed mode, owning their selection and GPU state; it reads
    the shard's host arrays."""

    def __init__(self, shard: Shard, fraction: float) -> None:
        self.shard, self.fraction = shard, fraction
        self.blocks: list[Block] = []
        self.selected_at = 0  # the step of the last selection (0: none yet)

    def watch(self, shards: list, model_params: list, flat_start) -> None:
        """Find the blocks: the engine's offloaded ``(group, param)`` shards within
        ``model_params`` (the model's own, whose shapes they lack)."""
        self.blocks = blocks_of(shards, model_params, self.fraction, flat_start)

    def due(self, step: int, first_delayed: int) -> bool:
        """Whether update ``step`` selects anew: the first delayed one, then every SELECT_EVERY
        (a run resumed from a checkpoint without a selection, at once)."""
        if not self.blocks:
            return False
        return not self.selected_at or (step - first_delayed) % SELECT_EVERY == 0

    def select(self, step: int, grad_of) -> None:
        """At update ``step``, with the CPU idle: the current selection's GPU state back into
        the host arrays, the columns with the largest summed |gradient| (``grad_of(param)``,
        the clipped gradients) chosen, and their state taken from the host."""
        import torch

        self.write_back()
        for b in self.blocks:
            score = b.in_param(grad_of(b.param)).float().abs().sum(0)
            k = max(1, round(self.fraction * b.width))
            b.index = torch.topk(score, k, sorted=False).indices.sort().values
        self.take_from_host()
        self.selected_at = step

    def take_from_host(self) -> None:
        """The selected columns' masters and moments from the host arrays onto the device."""
        s = self.shard
        for b in self.blocks:
            on_host = b.index.cpu()
            b.master, b.exp_avg, b.exp_avg_sq = (
                b.of(flat)[:, on_host].to(s.device, non_blocking=True)
                for flat in (s.master, s.exp_avg, s.exp_avg_sq)
            )

    def write_back(self) -> None:
        """The GPU's state of the selected columns into the host arrays (the CPU idle)."""
        s = self.shard
        for b in self.blocks:
            if b.index is None:
                continue
            on_host, states = b.index.cpu(), (b.master, b.exp_avg, b.exp_avg_sq)
            for flat, state in zip((s.master, s.exp_avg, s.exp_avg_sq), states, strict=True):
                b.of(flat)[:, on_host] = state.cpu()

    def step(self, step: int, hypers: list[dict], grad_of) -> None:
        """Adam on the selected columns (their clipped gradients) and the result rounded into
        their bf16 parameters, on the compute stream after the landings."""
        import torch

        if not self.selected_at:
            return
        steps = torch.full((), float(step), device=self.shard.device)
        by_group: dict[int, list[tuple[Block, object]]] = {}
        for b in self.blocks:
            grad = b.in_param(grad_of(b.param)).index_select(1, b.index).float()
            by_group.setdefault(b.group, []).append((b, grad))
        for group, items in by_group.items():  # one multi-tensor AdamW per param group
            states = [(b.master, g, b.exp_avg, b.exp_avg_sq) for b, g in items]
            adamw(*(list(column) for column in zip(*states, strict=True)), steps, hypers[group])
        for b in self.blocks:
            b.in_param(b.param).index_copy_(1, b.index, b.master.to(b.param.dtype))

    def checkpointed(self, param_groups: list) -> None:
        """The selection into the param groups (the state went back to the host arrays)."""
        if self.selected_at and param_groups:
            param_groups[0][COLUMNS] = (self.selected_at, [b.index.tolist() for b in self.blocks])

    def restore(self, param_groups: list) -> None:
        """A saved run's selection, its state taken from the loaded host arrays. Any selection
        is a valid one (the host arrays hold every column's state): where a checkpoint keeps one
        rank's param groups for all (data parallelism), the others' resume is exact but not bit
        for bit."""
        import torch

        saved = param_groups[0].get(COLUMNS) if param_groups else None
        if saved is None or len(saved[1]) != len(self.blocks):
            return
        self.selected_at = saved[0]
        for b, index in zip(self.blocks, saved[1], strict=True):
            b.index = torch.tensor(index, dtype=torch.long, device=self.shard.device)
        self.take_from_host()
