"""``deepspeed.initialize`` / ``init_distributed`` / ``add_config_arguments`` with DeepSpeed's signatures,
built on ``plait.initialize``."""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

import plait
from plait.config import ConfigError
from plait.parallel import launch


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method=None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the launcher's process group (torchrun or SLURM environment), as ``deepspeed.init_distributed``;
    a no-op when one exists. The group is left at every exit (``plait.parallel.launch.leave_at_exit``).

    ``timeout``: None (default; DeepSpeed's is 30 minutes): plait's ``comm`` timeouts, 600 s until the engine
    exists, then its config's ``comm.startup_timeout_s`` and, after the first step, ``comm.timeout_s``. A
    ``timedelta`` the script passes holds for every collective of the run (the engine logs that it replaces
    the config's ``comm`` values).

    Raises:
        ValueError: ``init_method``, ``rank`` or ``world_size`` given (plait reads them from the
            launcher's environment: start the script with torchrun or srun).
    """
    if init_method is not None or rank != -1 or world_size != -1:
        raise ValueError(
            "plait.deepspeed.init_distributed reads rank, world size and address from the launcher's "
            "environment (torchrun, srun); drop init_method/rank/world_size and launch with torchrun"
        )
    if dist.is_initialized() or dist_init_required is False:
        return
    launch.init_distributed(
        dist_backend, timeout_s=None if timeout is None else timeout.total_seconds()
    )
    launch.leave_at_exit()


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags (``--deepspeed``, ``--deepspeed_config`` and the older
    ``--deepscale``, ``--deepscale_config``) to ``parser``; ``initialize(args=...)`` reads them."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable the engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="ds_config JSON path")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ConfigError(
            "initialize got both config= and config_params=; pass one (they are the same argument)"
        )
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ConfigError(
            f"initialize got config= and args.deepspeed_config={from_args!r}; pass one"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError(
            "initialize needs a ds_config: pass config= (a path or a dict) or "
            "args.deepspeed_config (deepspeed.add_config_arguments adds the flag)"
        )
    return config


def scheduler_factory(lr_scheduler, optimizer):
    """plait builds its optimizer over the fp32 master shards, so a schedule *instance* bound to the
    user's optimizer is moved onto it (same groups, same step count); a callable is called with it."""
    if lr_scheduler is None or not (
        hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "optimizer")
    ):
        return lr_scheduler
    if lr_scheduler.optimizer is not optimizer:
        raise ValueError(
            "lr_scheduler is bound to an optimizer that was not passed as optimizer=; pass that "
            "optimizer too, or pass a callable f(optimizer) -> scheduler"
        )

    def rebind(inner):
        old = lr_scheduler.optimizer.param_groups
        if len(inner.param_groups) != len(old):
            raise ValueError(
                f"the schedule has {len(old)} param groups but plait's optimizer has "
                f"{len(inner.param_groups)}; pass lr_scheduler as a callable f(optimizer)"
            )
        for new, before in zip(inner.param_groups, old):
            new["initial_lr"] = before.get("initial_lr", before["lr"])
            new["lr"] = before["lr"]
        lr_scheduler.optimizer = inner
        _track_steps(inner)
        return lr_scheduler

    return rebind


def _track_steps(opt) -> None:
    """Mark ``opt.step`` the way torch's schedules do when they are built on an optimizer (they check it
    to warn about a schedule stepped before its optimizer), so the moved schedule does not warn."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    def tracked(*args, **kwargs):
        opt._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    opt.step = tracked


def _loader(training_data, engine, collate_fn, drop_last: bool):
    """DeepSpeed's training loader: micro-batches of ``train_micro_batch_size_per_gpu``; each dp rank
    draws its own part of a shuffled order (``DistributedSampler``; ``RandomSampler`` at dp 1)."""
    if training_data is None:
        return None
    mesh = engine.mesh
    if mesh.dp > 1:
        sampler = DistributedSampler(training_data, num_replicas=mesh.dp, rank=mesh.dp_rank)
    else:
        sampler = RandomSampler(training_data)
    return DataLoader(
        training_data,
        batch_size=engine.train_micro_batch_size_per_gpu(),
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
    )


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = 29500,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """``deepspeed.initialize`` on plait.

    Args (DeepSpeed's): ``args`` (argparse namespace; ``args.deepspeed_config`` is the config when
    ``config`` is None), ``model``, ``optimizer`` (an instance, or a callable ``f(params)``; None: the
    config's ``optimizer``), ``model_parameters`` (None: every parameter, one group with the config's
    weight decay, as DeepSpeed; or param-group dicts, used exactly as given), ``training_data`` (a
    ``Dataset``: the returned loader), ``lr_scheduler`` (an instance bound to ``optimizer``, or a callable
    ``f(optimizer)``; None: the config's ``scheduler``), ``collate_fn``, ``config`` / ``config_params`` (a
    path or a dict), ``dist_init_required``.

    Returns:
        ``(engine, engine.optimizer, training_dataloader or None, engine.lr_scheduler)``.

    Raises:
        ValueError: ``mpu`` or ``mesh_param`` given (use ``tensor_parallel``/``pipeline`` config sections),
            or a process group is needed while ``dist_init_required`` is False.
        ConfigError: no config, or two of them.
    """
    _refuse(model, mpu, mesh_param, dist_init_required)
    init_distributed()
    source = _config_source(args, config, config_params)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer) and model_parameters is not None:
        model_parameters = None  # the instance's own param groups are used exactly
    engine = plait.initialize(
        model,
        source,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=scheduler_factory(lr_scheduler, optimizer),
    )
    loader = _loader(
        training_data, engine, collate_fn, drop_last=False
    )  # dataloader_drop_last: true is refused
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _refuse(model, mpu, mesh_param, dist_init_required) -> None:
    """Raises ValueError: ``initialize``'s arguments plait does not serve, or no model (see ``initialize``)."""
    if mpu is not None or mesh_param is not None:
        raise ValueError(
            "plait builds its own tensor/pipeline groups: drop mpu=/mesh_param= and set "
            '"tensor_parallel": {"size": N} and "pipeline": {"size": N} in the config'
        )
    if model is None:
        raise ValueError("initialize needs model=")
    if (
        dist_init_required is False
        and not dist.is_initialized()
        and launch.launcher_world_size() > 1
    ):
        raise ValueError(
            "dist_init_required=False but no process group exists under a launcher of "
            f"{launch.launcher_world_size()} processes; call init_distributed() first"
        )
