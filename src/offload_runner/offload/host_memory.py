"""Host buffers for the offload engines: plain allocations, page-locked with ``cudaHostRegister``
where the copy engines read or write them.

torch's pinned-memory allocator rounds every block up to a power of two (34.8 GiB of optimizer
state became 49 GiB); registering an ordinary allocation pins exactly the bytes asked for. One
``HostArenas`` owns the buffers of one engine and unpins them when it is released.

Every arena comes zeroed and is an anonymous mapping of its own, kept out of forked children
(``MADV_DONTFORK``):
the data loader forks its workers after the engines have allocated, and Linux copies page-locked
pages into each child at fork (they cannot be shared copy-on-write) while the pageable ones become
copy-on-write, doubling once the trainer writes them. Measured on the Qwen3-30B-A3B proxy: 52 GB
of CPU-Adam host arrays and two loader workers exhausted a 128 GB host, and steps took 5-50 s
instead of about one.

Start-up: ``cudaHostRegister`` faults in every page it has not seen on one thread, 4 KiB at a
time. Each arena is therefore advised transparent huge pages and written once by torch's
intra-op threads (``zero_``) before it is registered: 8 GB took 0.37 s that way against 3.12 s
registered untouched, and the GPU's copies into it ran at the same 54 GB/s (one H100,
docs/evidence/host-pinning-probe-h100.txt, ``bench/probes/host_pinning_probe.py``).
"""

from __future__ import annotations

from offload_runner.progress import timed_line

ALIGN = 4096  # slices of an arena start on page boundaries
MADV_DONTFORK, MADV_HUGEPAGE = 10, 14  # linux/mman.h


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostArenas:
    """Host allocations of one offload engine; ``pin=True`` ones are page-locked for DMA."""

    def __init__(self) -> None:
        self._arenas: list[object] = []
        self._registered: list[int] = []

    def allocate(self, nbytes: int, pin: bool, what: str = "offload"):
        """A flat uint8 tensor of ``nbytes`` zeros on the host (page-locked when ``pin``)."""
        import torch

        doing = f"page-locking {{size}} of host memory for {what}"
        said = timed_line(doing, "page-locked", nbytes) if pin else lambda: None
        arena = torch.empty(0, dtype=torch.uint8)
        if nbytes:
            arena = torch.frombuffer(_private_pages(nbytes), dtype=torch.uint8, count=nbytes)
            arena.zero_()  # faults its pages in on torch's threads, not on the driver's one
        if pin and nbytes:
            status = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), nbytes, 0)
            said()
            if int(status) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {nbytes / 1e9:.1f} GB failed ({status}): not enough "
                    f"page-lockable host memory for {what} (see ulimit -l)"
                )
            self._registered.append(arena.data_ptr())
        self._arenas.append(arena)
        return arena

    def __len__(self) -> int:
        return len(self._arenas)

    @property
    def nbytes(self) -> int:
        return sum(arena.numel() for arena in self._arenas)

    @property
    def pinned_bytes(self) -> int:
        pinned = set(self._registered)
        return sum(a.numel() for a in self._arenas if a.data_ptr() in pinned)

    def release(self) -> None:
        """Unpin and drop every buffer (after the copies that use them have finished)."""
        import torch

        if self._registered:
            torch.cuda.synchronize()
            for pointer in self._registered:
                torch.cuda.cudart().cudaHostUnregister(pointer)
        self._arenas, self._registered = [], []


def park(module) -> HostArenas:
    """Every CUDA parameter and buffer of ``module`` moved into one page-locked host arena (the
    returned one: release it once they have gone back to the GPU). The same move as
    ``module.cpu()`` at the link's rate: that one copies into pageable memory one tensor at a
    time, 55 s of the whole Qwen3-30B-A3B's 75 s build on one H200 (bench/probes/sampler)."""
    import torch

    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_cuda]
    sizes = [aligned(t.numel() * t.element_size()) for t in tensors]
    arenas = HostArenas()
    arena = arenas.allocate(sum(sizes), pin=True, what="the model on its way to DDP")
    start = 0
    for tensor, size in zip(tensors, sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        view = arena[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.data, non_blocking=True)
        tensor.data = view
        start += size
    torch.cuda.synchronize()
    return arenas


def _private_pages(nbytes: int):
    """An anonymous private mapping of its own pages, kept out of forked children
    (``MADV_DONTFORK``). Its own mapping, not a malloc'ed block: a block from a malloc heap
    shares pages with other allocations and the allocator's own bookkeeping, which a child
    would then lose (measured: forked children crashed at fork, now and then, in glibc's
    at-fork handler)."""
    import contextlib
    import mmap

    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice in (
        getattr(mmap, "MADV_DONTFORK", MADV_DONTFORK),
        getattr(mmap, "MADV_HUGEPAGE", MADV_HUGEPAGE),
    ):
        with contextlib.suppress(OSError, AttributeError, ValueError):  # not Linux, or no THP
            region.madvise(advice)
    return region
