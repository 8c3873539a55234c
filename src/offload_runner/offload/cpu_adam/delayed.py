"""Delayed mode of the CPU-Adam engine: the order the worker takes a delayed update's pieces in,
the step boundary's copies during the last micro-batch's backward (with the clip factor applied
on the CPU afterwards), the update in flight, and weight prediction's extrapolation."""

from __future__ import annotations

import concurrent.futures
import time

from offload_runner.offload.cpu_adam.landing import Link
from offload_runner.offload.cpu_adam.shard import Shard
from offload_runner.offload.cpu_adam.update import Update
from offload_runner.offload.host_adam import PieceSpans, after_each_grad

LAST_LR = "last_update_lr"  # param-group key: the learning rate of the last update
GUESS_BLOCK = 4 * 1024**2  # elements: weight prediction's copy, Adam and extrapolation in turn


class Delay:
    """A CpuAdam's delayed mode, owning the update not landed yet (and its worker's job), the
    backward's hooks and what they copied, and whether the guess is made; it reads the shard's
    pieces and host arrays, copies through ``link`` and knows gradient clipping's norm."""

    def __init__(self, shard: Shard, link: Link, clip_grad: float) -> None:
        self.shard, self.link, self.clip_grad = shard, link, clip_grad
        self.pending: Update | None = None  # a delayed update, not landed
        self.jobs: list[concurrent.futures.Future] = []  # ... its worker's job
        self.guessed = False  # host_guess holds the next weights' extrapolation
        self.grad_hooks: list = []
        self.hooked: dict[int, object] = {}  # id(param) -> param, the backward hooks' params
        self.param_pieces: dict[int, list[int]] | None = None  # id(param) -> pieces it touches
        self.piece_params: list[int] = []  # per piece: how many hooked params touch it
        self.remaining: list[int] | None = None  # armed: per piece, params not yet final
        self.previous: Update | None = None  # armed: the update the backward lands
        self.early: dict[int, concurrent.futures.Future] = {}  # piece -> its copies' job
        self.taken_s = 0.0  # copies_taken's wait for them, before this step()

    def order(self, delayed: bool, crossed: list[int], on_cpu: int, forward: bool) -> list[int]:
        """The order the worker takes the pieces in. Exact: the pieces' own (``forward`` order
        where the next forward waits for them), the CPU's share of them (the first ``on_cpu``).
        Delayed: the order their
        gradients went down during the backward (``crossed``), then backward-ready order: the
        worker starts on the gradients that are down first, and the next step lands its pieces
        in that order again (during the backward, or at ``step()``, which follows this order
        too); in forward order it would start on the first layers' gradients, the last to come
        down, and every landing of the next backward would wait for the update's end."""
        pieces = range(len(self.shard.pieces))
        if not delayed:
            return list(pieces[:on_cpu])
        backward = pieces[::-1] if forward else pieces  # the DDP buffer's order
        seen = set(crossed)
        return crossed + [i for i in backward if i not in seen]

    def watch_backward(self, chunks) -> None:
        """Copy during the last micro-batch's backward: a hook after each parameter's gradient
        accumulation (registered after Megatron-Core DDP's own, on the same autograd node, so the
        DDP buffer holds the gradient when it runs) counts the parameters of each piece whose
        gradients are final; when a piece's are, its gradients go down and the last update's
        masters come up into its parameters, which no later part of the backward reads. Armed by
        ``arm`` (the schedule's ``no_sync`` exit: the last micro-batch follows); only on a shard
        whose gradients nothing edits after the backward (``OffloadMode.copies_during_backward``);
        the CPU applies the clip factor (``grads_clipped``)."""
        self.grad_hooks += after_each_grad(chunks, self._after_grad)
        self.hooked.update(
            (id(p), p) for chunk in chunks for p in chunk.parameters() if p.requires_grad
        )

    def arm(self, spans: PieceSpans | None) -> None:
        """The last micro-batch's backward follows: where the coming step is delayed and the
        backward is watched (``spans`` of the planned pieces given), this step's gradients go
        down during it (the exact steps before need them clipped at ``step()``)."""
        self.early.clear()
        if spans is None:
            self.remaining = None
            return
        if self.param_pieces is None:
            self.param_pieces = {key: spans.holding([p]) for key, p in self.hooked.items()}
            self.piece_params = [0] * len(self.shard.pieces)
            for pieces in self.param_pieces.values():
                for i in pieces:
                    self.piece_params[i] += 1
        self.previous = self.pending
        self.remaining = list(self.piece_params)

    def _after_grad(self, param) -> None:
        """A parameter's gradient is accumulated: the pieces it completes start their copies."""
        remaining = self.remaining
        if remaining is None:
            return
        link = self.link
        for i in self.param_pieces.get(id(param), ()):
            remaining[i] -= 1
            if remaining[i] == 0:
                event = None
                if link.streams is not None:  # the backward so far, on this thread's stream
                    import torch

                    event = torch.cuda.Event()
                    event.record()
                self.early[i] = link.lander.submit(self.cross, i, self.previous, event)

    def cross(self, i: int, previous: Update | None, after=None) -> None:
        """Piece ``i`` across the step boundary: the last update's masters up once the worker
        has them (``previous``: the update not landed, if any), this step's gradients down, both
        after the CUDA event ``after`` where given (the landing thread during the backward, else
        ``step()``)."""
        link, piece = self.link, self.shard.pieces[i]
        if previous is not None:
            previous.done[i].wait()
            if previous.failed:
                return  # step() raises the worker's error
            link.land(piece, previous.guess, after)
        link.fetch(piece, after)

    def copies_taken(self) -> None:
        """Before Megatron-Core's step, whose clipping scales the gradients in place: the copies
        down that the backward started are enqueued (each may have waited for the worker's last
        update of its piece), and the compute stream waits for them, so none reads a clipped
        gradient (``grads_clipped`` divides by the factor once). Its wait counts in the step's
        boundary time (``Update.boundary_s``)."""
        began = time.perf_counter()
        for job in self.early.values():
            job.result()
        self.taken_s = time.perf_counter() - began
        if self.early:
            self.link.downs_done()

    def grads_clipped(self, grad_norm: float | None) -> None:
        """After Megatron-Core's step (whose clipping scaled the GPU gradients by clip_grad /
        (grad_norm + 1e-6) where that is below 1): the gradients copied during the backward
        were taken before, so the worker divides them by the inverse of that factor."""
        update, clip = self.pending, self.clip_grad
        if update is None or update.scaled.is_set():
            return
        coeff = clip / (float(grad_norm) + 1.0e-6) if clip > 0 and grad_norm is not None else 1.0
        if coeff < 1.0:
            import torch

            update.grad_scale = torch.tensor(1.0 / coeff, dtype=torch.float32)
        update.scaled.set()

    def guess_from_states(self, step: int, ranges: list[tuple[int, int, dict]]) -> None:
        """The extrapolation from Adam's state alone (after a checkpoint load, where the masters
        before the last update are gone): update ``step`` (the last) recomputed from exp_avg,
        exp_avg_sq and its hyperparameters (``ranges``: each parameter's elements and its
        group's), added once more."""
        if step < 1:
            self.shard.guess.copy_(self.shard.master)
        else:
            for a, b, h in ranges:
                self._extrapolate(a, b, h, step)
        self.guessed = True

    def _extrapolate(self, a: int, b: int, h: dict, step: int) -> None:
        """host_guess[a:b] = master - lr wd master - lr / (1 - beta1^t) m / (sqrt(v / (1 -
        beta2^t)) + eps): torch's AdamW update of step t applied once more."""
        s = self.shard
        guess, master = s.guess[a:b], s.master[a:b]
        bias1, bias2 = 1 - h["beta1"] ** step, 1 - h["beta2"] ** step
        guess.copy_(s.exp_avg_sq[a:b]).sqrt_().div_(bias2**0.5).add_(h["eps"])
        guess.reciprocal_().mul_(s.exp_avg[a:b]).mul_(-h["lr"] / bias1)
        guess.add_(master, alpha=1 - h["lr"] * h["weight_decay"])

    def close(self) -> None:
        for _, hook in self.grad_hooks:
            hook.remove()
        self.grad_hooks.clear()


def before_clip(built: list) -> None:
    """Before Megatron-Core's ``optimizer.step()``: the engines' copies during the backward have
    read the gradients (``CpuAdam.copies_taken``)."""
    for engine in built:
        engine.copies_taken()


def grads_clipped(built: list, grad_norm: float | None) -> None:
    """After Megatron-Core's ``optimizer.step()``: its grad norm to the engines whose gradients
    went down before the clipping (``CpuAdam.grads_clipped``)."""
    for engine in built:
        engine.grads_clipped(grad_norm)
