"""The host engines of one rank (CPU Adam, windowed states, weight offload) behind the few calls
the training loop makes: built after the optimizer, ``attach``ed to the schedule's config,
``begin_step`` and ``step`` each iteration, ``before_save``, ``flush`` at the end, ``metrics``
for the summary and ``close`` in a ``finally``. What each engine does: docs/ARCHITECTURE.md."""

from __future__ import annotations

from typing import Protocol

from offload_runner.config.schema import RunConfig
from offload_runner.plan import rebuilt_bytes


class HostEngine(Protocol):
    """What ``Engines`` asks of each engine it holds (HostAdam's kinds, WeightOffload); the
    rest of their work runs inside Megatron-Core's optimizer step and the model's hooks."""

    @property
    def pinned_bytes(self) -> int: ...  # its page-locked host memory

    def finish(self) -> None: ...  # host state complete for a checkpoint (not landed)

    def flush(self) -> None: ...  # its last update landed: the model in memory is final

    def close(self) -> None: ...  # its threads, host memory and hooks released


class Engines:
    """A rank's host engines; none where nothing is offloaded (every call then does Megatron-
    Core's own thing, or nothing)."""

    def __init__(self, run: RunConfig, model: list, optimizer) -> None:
        """After the optimizer is built: the engines found in it and the model, weight
        offload's layers given back their gradients (outside DDP's buffers)."""
        from offload_runner.offload import cpu_adam, host_adam, weight

        self.run, self.model, self.optimizer = run, model, optimizer
        self.cpu_adam = cpu_adam.engines(optimizer)
        self.weights = weight.of(model)
        self.all: list[HostEngine] = [*host_adam.engines(optimizer), *self.weights]
        self._attached = None  # the state windows' hooks (attach)
        for offload in self.weights:
            offload.arm()

    def attach(self, config, no_sync) -> None:
        """Into the schedule's config and the model's backward: the engines that act during
        the last micro-batch's backward armed at ``no_sync``'s exit (delayed CPU Adam's copies,
        the state windows' growth), the windows' first pieces prefetched in the gradient
        finalize hook (set before this), state offload's passes beside the next forward."""
        import torch.distributed as dist

        from offload_runner.offload import host_adam, optimizer_states

        config.no_sync_func = host_adam.arming(no_sync, host_adam.engines(self.optimizer))
        reserve = rebuilt_bytes(self.run, dist.get_rank(), dist.get_world_size())
        self._attached = optimizer_states.attach(self.optimizer, config, self.model, reserve)

    def zero_grad_buffers(self) -> None:
        """Megatron-Core DDP's ``zero_grad_buffer`` of every model chunk, at a step's start
        (behind state offload's passes where they run beside the forward: they read them)."""
        beside = self._attached.beside if self._attached is not None else None
        if beside is not None:
            beside.zero_grad_buffers()
            return
        for chunk in self.model:
            chunk.zero_grad_buffer()

    def begin_step(self, micro_batches: int) -> None:
        for offload in self.weights:
            offload.begin_step(micro_batches)

    def step(self):
        """Megatron-Core's optimizer step (and the host engines'), once the copies the last
        backward started have read their gradients; returns the gradient norm.
        With weight offload the norm takes in the offloaded layers' gradients on the host: the
        GPU's gradients are clipped by the global factor first (so Megatron-Core's own clipping
        finds nothing to do), the offloaded layers' in their update."""
        from offload_runner.offload import cpu_adam, weight

        cpu_adam.before_clip(self.cpu_adam)  # the clipping below writes the gradients in place
        if self.weights:
            sq = [weight.gpu_grad_sq_norm(self.model), *(o.grads_ready() for o in self.weights)]
            norm, factor = weight.clip_factor(sq, self.run.optimizer.clip_grad)
            weight.scale_gpu_grads(self.model, factor)
        _, grad_norm, _ = self.optimizer.step()
        if self.weights:
            hypers = weight.hypers_of(self.optimizer)
            for offload in self.weights:
                offload.update(hypers, factor)
            grad_norm = norm
        cpu_adam.grads_clipped(self.cpu_adam, grad_norm)  # gradients taken before clipping
        return grad_norm

    def before_save(self) -> None:
        """Host masters and states complete (a delayed update: not landed)."""
        for engine in self.all:
            engine.finish()

    def flush(self) -> None:
        """The last delayed update lands: the model in memory is final."""
        for engine in self.all:
            engine.flush()

    @property
    def pinned_bytes(self) -> int:
        return sum(engine.pinned_bytes for engine in self.all)

    def metrics(
        self, forward_backward_s: float | None, micro_batches: int, dp_size: int, is_writer: bool
    ) -> dict:
        """summary.json's fields of every engine (the writer rank also says delayed mode's
        hidden fraction: its copies run during the last backward where that is allowed)."""
        from offload_runner.offload import cpu_adam, optimizer_states

        run = self.run
        window = micro_batches if run.mode.backward_copies_allowed(dp_size) else None
        found = cpu_adam.metrics(self.optimizer, forward_backward_s, run.planner, window)
        if is_writer:
            cpu_adam.report_hidden_fraction(found, run.planner)
        found.update(optimizer_states.metrics(self.optimizer))
        for offload in self.weights:
            found.update(offload.metrics())
        return found

    def close(self) -> None:
        """Their threads, host memory and backward hooks go (on failure and Ctrl-C too: call in
        ``finally``)."""
        if self._attached is not None:
            self._attached.remove()
            self._attached = None
        for engine in self.all:
            engine.close()
