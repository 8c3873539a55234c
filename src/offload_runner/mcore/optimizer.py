"""The optimizer (get_megatron_optimizer: distributed optimizer, HybridDeviceOptimizer, or one of
offload-runner's engines inside it: CPU Adam, windowed state offload) and its learning-rate
schedule."""

from __future__ import annotations

from offload_runner.config.schema import LRDecayStyle, RunConfig


def build_optimizer(run: RunConfig, model: list, local_rank: int = 0, local_world: int = 1):
    """Megatron-Core's optimizer; with offload/optimizer=cpu_adam* its inner optimizers are
    offload-runner's CPU-Adam engines (``local_rank``/``local_world`` pick the rank's cores), with
    offload/optimizer=states its windowed state-offload engines."""
    from megatron.core.optimizer import get_megatron_optimizer

    from offload_runner.mcore.megatron_config import build_optimizer_config
    from offload_runner.offload import cpu_adam, optimizer_states

    optimizer = get_megatron_optimizer(build_optimizer_config(run.optimizer, run.model), model)
    if run.mode.cpu_adam:
        cpu_adam.attach(run, optimizer, local_rank, local_world)
    if run.mode.states:
        optimizer_states.install(run, optimizer)
    return optimizer


def build_scheduler(run: RunConfig, optimizer):
    """Warmup then decay, counted in samples as Megatron-LM does (step(increment=batch))."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, s, t = run.optimizer, run.scheduler, run.train
    batch = t.global_batch_size
    decay_steps = max(s.lr_decay_iters or t.train_iters, s.lr_warmup_iters + 1) * batch
    wd = (
        o.weight_decay if s.start_weight_decay is None else s.start_weight_decay,
        o.weight_decay if s.end_weight_decay is None else s.end_weight_decay,
    )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init if s.lr_warmup_iters else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr if s.lr_decay_style != LRDecayStyle.constant else o.lr,
        lr_warmup_steps=s.lr_warmup_iters * batch,
        lr_decay_steps=decay_steps,
        lr_decay_style=s.lr_decay_style.value,
        start_wd=wd[0],
        end_wd=wd[1],
        wd_incr_steps=decay_steps,
        wd_incr_style=s.weight_decay_incr_style.value,
        wsd_decay_steps=s.lr_wsd_decay_iters * batch if s.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=s.lr_wsd_decay_style.value,
        use_checkpoint_opt_param_scheduler=(
            s.use_checkpoint_opt_param_scheduler and not s.override_opt_param_scheduler
        ),
        override_opt_param_scheduler=s.override_opt_param_scheduler,
    )
