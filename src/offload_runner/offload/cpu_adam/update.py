"""One CPU update: what ``CpuAdam.step`` hands the worker, and what the worker measured."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Update:
    """One CPU update: the hyperparameters captured at ``step()`` and what the worker measured."""

    step: int
    hyper: list[dict]  # per param group: lr, weight_decay, beta1, beta2, eps
    land_in_worker: bool
    on_cpu: int = 0  # pieces [0, on_cpu) run on the CPU (exact mode's GPU share follows them)
    params: int = 0  # ... holding this many params
    guess: bool = False  # also extrapolate the updated masters into host_guess
    # threading.Event per piece: its gradients' copy (and any landing before it) is enqueued
    ready: list = field(default_factory=list)
    order: list = field(default_factory=list)  # the pieces' indices in the order the worker takes
    # delayed mode's GPU share: the worker splits ``order`` (``late_share``), the pieces that
    # pass through the window instead of the CPU (``on_gpu``)
    late_share: bool = False
    on_gpu: list = field(default_factory=list)
    done: list = field(default_factory=list)  # threading.Event per piece: Adam has run on it
    # threading.Event per piece, exact mode: its landing is enqueued (or the update failed)
    landed: list = field(default_factory=list)
    waited: int = 0  # landing during the forward: the pieces before this one are waited for
    # delayed mode copying during the backward: per piece, its gradients went down before the
    # clipping; the worker divides them by grad_scale (1 / Megatron-Core's clip factor, None:
    # no clipping) once ``scaled`` is set (grads_clipped, after the step's grad norm is known)
    unclipped: list = field(default_factory=list)
    scaled: threading.Event = field(default_factory=threading.Event)
    grad_scale: object = None
    # step(): from its start until every piece was handed to the worker (and, where the last
    # backward copied, the wait before the clipping for those copies: copies_taken)
    boundary_s: float = 0.0
    failed: bool = False  # the worker or a landing raised: job.result() says what
    cancelled: bool = False  # step() failed before every piece was ready: the worker stops
    busy_s: float = 0.0  # the worker's own work: its Adam calls
    wait_s: float = 0.0  # waiting for gradient copies
    forward_wait_s: float = 0.0  # landing during the forward: the forward waiting for it
    wall_s: float = 0.0

    def settle(self) -> None:
        """Drop the per-piece events once nothing waits on them (two updates later): the
        history keeps an update's timings for up to 2 x HISTORY steps, and each event is six
        objects the collector tracks (the proxy's 186 pieces: 3,300 objects and 0.65 MB a step,
        0.65 GB and 3.3M objects over 1,000 steps without this)."""
        self.ready, self.done, self.landed = [], [], []
