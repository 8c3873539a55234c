"""Host buffers for the offload engines: plain allocations, page-locked with ``cudaHostRegister``
where the copy engines read or write them.

torch's pinned-memory allocator rounds every block up to a power of two (34.8 GiB of optimizer
state became 49 GiB); registering an ordinary allocation pins exactly the bytes asked for. One
``HostArenas`` owns the buffers of one engine and unpins them when it is released.
"""

from __future__ import annotations

ALIGN = 4096  # slices of an arena start on page boundaries


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostArenas:
    """Host allocations of one offload engine; ``pin=True`` ones are page-locked for DMA."""

    def __init__(self) -> None:
        self._arenas: list[object] = []
        self._registered: list[int] = []

    def allocate(self, nbytes: int, pin: bool, what: str = "offload"):
        """A flat uint8 tensor of ``nbytes`` on the host (page-locked when ``pin``)."""
        import torch

        arena = torch.empty(nbytes, dtype=torch.uint8)
        if pin and nbytes:
            status = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), nbytes, 0)
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
