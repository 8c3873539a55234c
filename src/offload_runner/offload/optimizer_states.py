"""Optimizer-state offload: Adam on the GPU, its states and fp32 master weights wait on the CPU.

Not in any megatron-core release. Between steps exp_avg, exp_avg_sq and the fp32 master weights
of this rank's distributed-optimizer shard live in pinned host buffers, and their GPU storage is
released to the caching allocator (so forward and backward can use it). The timeline of a step:

1. ``optimizer.step()`` runs as usual (Adam on the GPU: Transformer Engine's FusedAdam, or
   whatever Adam Megatron-Core picked), then copies the masters into the bf16 parameters.
2. ``offload()``: the side stream ``d2h`` waits for that, copies every tensor into its pinned
   buffer (in ``chunk_bytes`` pieces, so forward's own small copies, e.g. MoE token counts, are
   not queued behind gigabytes on the copy engine), and the GPU storage is released at once
   (``record_stream`` keeps the allocator from reusing it before the copy has finished).
3. Forward and backward of the next iteration run without the states.
4. ``start_reload()`` (called when Megatron-Core finalizes the gradients, i.e. at the tail of
   backward, before the data-parallel gradient reduction): storage is re-allocated on the compute
   stream, and the side stream ``h2d`` copies the pinned buffers back.
5. The inner optimizer's step pre-hook makes the compute stream wait for ``h2d``: gradient
   unscaling, norm and clipping overlap with the copy; only Adam itself waits.

The first step has only the masters to bring back (Adam creates its states lazily in its first
step); the states are found anew at every offload, so states created later (first step,
checkpoint load) are included. Pinned buffers are allocated once per tensor and reused.

Which tensors move: the fp32 masters of bf16 parameters (``shard_fp32_from_float16_groups``;
fp32 parameters' shards are views of the model's own weights and stay), and the ``exp_avg``,
``exp_avg_sq`` (and ``master_param``, for precision-aware Adam) entries of the inner optimizer's
state. Any other optimizer state stays on the GPU; the validation table admits Adam only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from offload_runner.config.schema import RunConfig
from offload_runner.model_size import count_parameters
from offload_runner.offload import OffloadSummary, optimizer_parts
from offload_runner.offload.host_memory import HostArenas, aligned

STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param")
BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq


DISABLED = {"optimizer.offload_optimizer_states": False}


def describe(run: RunConfig) -> OffloadSummary:
    enabled = run.optimizer.offload_optimizer_states
    if not enabled:
        return OffloadSummary("optimizer states", "offload/optimizer=states", False, "-")
    params = count_parameters(run.model).total
    return OffloadSummary(
        "optimizer states",
        "offload/optimizer=states",
        True,
        f"fp32 master + exp_avg + exp_avg_sq ({BYTES_PER_PARAM} B/param, ~"
        f"{params * BYTES_PER_PARAM / 1e9:.1f} GB for the whole model before DP sharding) "
        "between steps; Adam runs on the GPU",
        "back to the GPU during gradient reduction; Adam waits only for the copy",
    )


@dataclass
class _Slot:
    """One offloaded tensor, its host buffer, and the event that marks its copy to the host."""

    tensor: object  # torch.Tensor on the GPU; its storage is resized to 0 while offloaded
    host: object  # torch.Tensor (uint8) in a page-locked arena where the tensor is on CUDA
    nbytes: int
    copied: object = None  # torch.cuda.Event recorded after the D2H copy


class OptimizerStateOffloader:
    """Moves the optimizer states and fp32 masters of Megatron-Core distributed optimizers.

    ``optimizer`` is what ``get_megatron_optimizer`` returned (a DistributedOptimizer or a
    ChainedOptimizer of them, e.g. dense + expert parameters for MoE).

    Host memory: one pageable arena per batch of new tensors (the masters at attach, the Adam
    states after the first step), page-locked with ``cudaHostRegister``. torch's pinned-memory
    allocator would round every buffer up to a power of two (up to 2x the bytes).
    """

    def __init__(self, optimizer, chunk_bytes: int = 0) -> None:
        self.chunk_bytes = chunk_bytes  # copy granularity; 0: one copy per tensor
        self.parts = optimizer_parts(optimizer)
        for part in self.parts:
            if not hasattr(part, "shard_fp32_from_float16_groups"):
                raise TypeError(
                    f"offload_optimizer_states needs Megatron-Core's DistributedOptimizer, got "
                    f"{type(part).__name__}"
                )
        self._host: dict[tuple[int, str], object] = {}
        self._arenas = HostArenas()
        self._offloaded: list[_Slot] = []
        self._reloading = False
        self._streams = None
        self.peak_before_reload: int | None = None  # GPU peak of forward + backward, in bytes
        self._hooks = [p.optimizer.register_step_pre_hook(self._before_adam) for p in self.parts]

    # -- which tensors -------------------------------------------------------------------
    def _tensors(self) -> Iterator[tuple[tuple[int, str], object]]:
        """(key, tensor) for every master shard and Adam state tensor, once per storage."""
        seen: set[int] = set()
        for part in self.parts:
            for group in part.shard_fp32_from_float16_groups:
                for master in group:
                    yield from self._once(seen, (id(master), "master"), master)
            for param, state in part.optimizer.state.items():
                for key in STATE_KEYS:
                    value = state.get(key)
                    if value is not None and hasattr(value, "untyped_storage"):
                        yield from self._once(seen, (id(param), key), value)

    @staticmethod
    def _once(seen: set[int], key: tuple[int, str], tensor) -> Iterator[tuple[tuple, object]]:
        storage = tensor.untyped_storage()
        if tensor.numel() == 0 or storage.size() == 0 or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        yield key, tensor

    def _host_buffers(self, found: list[tuple[tuple[int, str], object]]) -> list[object]:
        """The host buffer of each tensor; tensors seen for the first time share a new arena."""

        def fits(key, tensor) -> bool:
            buffer = self._host.get(key)
            return buffer is not None and buffer.numel() == tensor.untyped_storage().size()

        new = [(key, tensor) for key, tensor in found if not fits(key, tensor)]
        if new:
            sizes = [tensor.untyped_storage().size() for _, tensor in new]
            offsets = [0]
            for size in sizes:
                offsets.append(offsets[-1] + aligned(size))
            arena = self._arenas.allocate(
                offsets[-1], pin=new[0][1].is_cuda, what="offload/optimizer=states"
            )
            for (key, _), start, size in zip(new, offsets, sizes, strict=False):
                self._host[key] = arena[start : start + size]
        return [self._host[key] for key, _ in found]

    def _stream_pair(self, on_cuda: bool):
        import torch

        if not on_cuda:
            return None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    # -- the three moves ----------------------------------------------------------------
    def offload(self) -> None:
        """Copy states and masters to the host asynchronously; release their GPU storage."""
        import torch

        self.wait_reload()
        found = list(self._tensors())
        if not found:
            return
        slots = [
            _Slot(tensor, host, host.numel())
            for (_, tensor), host in zip(found, self._host_buffers(found), strict=True)
        ]
        streams = self._stream_pair(slots[0].tensor.is_cuda)
        if streams is None:
            for slot in slots:
                _copy_in_chunks(slot.host, _bytes_of(slot.tensor), self.chunk_bytes)
        else:
            d2h = streams[0]
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                for slot in slots:
                    _copy_in_chunks(slot.host, _bytes_of(slot.tensor), self.chunk_bytes)
                    slot.tensor.record_stream(d2h)
                    slot.copied = torch.cuda.Event()
                    slot.copied.record(d2h)
        for slot in slots:
            slot.tensor.untyped_storage().resize_(0)
        self._offloaded = slots

    def start_reload(self) -> None:
        """Re-allocate on the compute stream, copy back on the side stream (no wait here).

        Each copy back waits only for its own copy out, so the two directions overlap when the
        reload starts before the offload has finished."""
        import torch

        if not self._offloaded or self._reloading:
            return
        if self._offloaded[0].tensor.is_cuda:
            self.peak_before_reload = torch.cuda.max_memory_allocated()
        for slot in self._offloaded:
            slot.tensor.untyped_storage().resize_(slot.nbytes)
        streams = self._stream_pair(self._offloaded[0].tensor.is_cuda)
        if streams is None:
            for slot in self._offloaded:
                _copy_in_chunks(_bytes_of(slot.tensor), slot.host, self.chunk_bytes)
        else:
            h2d = streams[1]
            h2d.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(h2d):
                for slot in self._offloaded:
                    h2d.wait_event(slot.copied)
                    _copy_in_chunks(_bytes_of(slot.tensor), slot.host, self.chunk_bytes)
        self._reloading = True

    def wait_reload(self) -> None:
        """Make the compute stream wait for the copies back (starting them if needed)."""
        import torch

        if not self._offloaded:
            return
        self.start_reload()
        if self._streams is not None:
            torch.cuda.current_stream().wait_stream(self._streams[1])
        self._offloaded, self._reloading = [], False

    def _before_adam(self, optimizer, args, kwargs) -> None:
        self.wait_reload()

    # -- integration ----------------------------------------------------------------------
    def finalize_grads_with_prefetch(self, finalize):
        """Wrap Megatron-Core's finalize_model_grads so the copies back start before it."""

        def finalize_and_prefetch(*args, **kwargs):
            self.start_reload()
            return finalize(*args, **kwargs)

        return finalize_and_prefetch

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """States and masters on the GPU inside (checkpoint save/load), offloaded after."""
        self.wait_reload()
        yield
        self.offload()

    @property
    def offloaded_bytes(self) -> int:
        return sum(slot.nbytes for slot in self._offloaded)

    @property
    def host_bytes(self) -> int:
        return self._arenas.nbytes

    def remove(self) -> None:
        """Bring everything back, detach from the optimizer, unpin the host arenas."""
        self.wait_reload()
        for handle in self._hooks:
            handle.remove()
        self._arenas.release()
        self._host = {}


def _bytes_of(tensor):
    """The whole storage of ``tensor`` as a flat uint8 tensor (views and dtypes alike)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _copy_in_chunks(dst, src, chunk_bytes: int) -> None:
    """``dst.copy_(src, non_blocking=True)`` as copies of at most ``chunk_bytes`` (1-D uint8), so
    the copy engine can run other streams' small copies (MoE routing's token counts) between
    them instead of after the whole tensor."""
    step = chunk_bytes or dst.numel()
    for start in range(0, dst.numel(), step):
        dst[start : start + step].copy_(src[start : start + step], non_blocking=True)


def attach(run: RunConfig, optimizer, transformer_config) -> OptimizerStateOffloader | None:
    """The offloader for ``run`` (None when off), wired into Megatron-Core's gradient finalize
    hook, with the masters already on their way to the host before the first forward."""
    if not run.optimizer.offload_optimizer_states:
        return None
    offloader = OptimizerStateOffloader(
        optimizer, chunk_bytes=run.optimizer.offload_states_chunk_mb * 1024**2
    )
    transformer_config.finalize_model_grads_func = offloader.finalize_grads_with_prefetch(
        transformer_config.finalize_model_grads_func
    )
    offloader.offload()
    return offloader


def resident(offloader: OptimizerStateOffloader | None):
    """Context in which every optimizer tensor is on the GPU (a no-op without offloader)."""
    return offloader.resident() if offloader else contextlib.nullcontext()
