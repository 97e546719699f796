"""``plait.initialize()``: from a model, a ds_config and (optionally) a mesh to an ``Engine``: the process
group and the mesh, the ranks' agreement on config and model, the weights of a meta-device model, the
device, the pipeline and the checks of the combinations the engine refuses, in that order.

Differences from ``deepspeed.initialize``: it returns the engine alone (not a 4-tuple), and a user
learning-rate schedule is passed as a factory ``f(optimizer)`` because ZeRO builds its own optimizer
over the fp32 master shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.config import ConfigError, PlaitConfig, load_config
from plait.engine.context import check_context_parallel
from plait.engine.core import Engine
from plait.engine.model import on_device
from plait.engine.pipeline import check_pipeline
from plait.engine.ranks import check_mesh_covers_world, check_ranks_agree, start_up
from plait.fit.check import fit_config
from plait.parallel.launch import init_distributed, launcher_world_size, leave_at_exit
from plait.parallel.mesh import ParallelMesh
from plait.parallel.rank_errors import report_errors_once
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.zero.weights import prepare_weights


def join_group() -> None:
    """Under torchrun or SLURM with no process group yet, join the job's (each rank would train alone);
    with one (plait's, the HF Trainer's, accelerate's), an error every rank raises is printed once
    (``plait.parallel.rank_errors``)."""
    if not dist.is_initialized() and launcher_world_size() > 1:
        init_distributed()
        leave_at_exit()
    if dist.is_initialized():
        report_errors_once()


def initialize(
    model,
    config,
    mesh: ParallelMesh | None = None,
    optimizer=None,
    lr_scheduler=None,
    model_parameters=None,
    weights=None,
    units=None,
    **config_facts,
) -> Engine:
    """Wrap ``model`` for training with ZeRO over the dp ranks (and tp/pp from ``mesh``).

    Args:
        model: any ``nn.Module`` (an unmodified Hugging Face model works), a plait model, or a
            ``PipelineParallel`` over this rank's stage chunks (``train_batch`` then runs its schedule;
            its ``micro_batches`` must equal ``gradient_accumulation_steps``). A model elsewhere is moved to
            the rank's device (its GPU when there is one). Under torchrun or SLURM with no process group
            yet, the job's group is started first (``init_distributed``).
        config: a ds_config path or dict (DeepSpeed key names), or a resolved ``PlaitConfig``.
        mesh: the ``ParallelMesh``; default: ``tensor_parallel.size`` x ``pipeline.size`` from the config
            over the initialized process group (or one process).
        optimizer: None (use the config's ``optimizer``), a torch optimizer class/factory, or an instance.
        lr_scheduler: None (use the config's ``scheduler``) or a factory ``f(optimizer) -> scheduler``.
        model_parameters: the parameters to train, exactly as given: an iterable of parameters (one group
            with the optimizer's options, weight decay on every one of them, as DeepSpeed) or torch param
            groups (dicts). None: plait's grouping (matrices decay; biases and norm weights do not).
        weights: for a model built under ``plait.zero.meta_parameters()`` (parameters on the meta device):
            a Hugging Face checkpoint folder (safetensors) or a ``plait.zero.weights.WeightSource``; under
            ZeRO-3 each rank reads only its shard of the parameters (``plait.zero.weights``).
        units: ZeRO-3's gather units, modules of ``model`` (the root gathers what none encloses); None: plait's
            choice (``plait.engine.model.stage3_units``: the blocks, and each other module with parameters).
        config_facts: extra facts for "auto" values (e.g. ``model_hidden_size``, ``lr``), see ``load_config``.

    Raises:
        ConfigError: unknown or inconsistent config keys (named, with the fix), or ranks started with
            different configs or models (the same message on every rank, naming keys, values and ranks).
        ValueError: parameters on the meta device without ``weights``, ``weights`` for a model whose
            parameters are not on the meta device, or a checkpoint tensor of another shape.
    """
    join_group()
    config, mesh = config_and_mesh(model, config, mesh, config_facts)
    config = start_up(
        config, model, mesh
    )  # the ranks agree; comm.startup_timeout_s holds from here
    if config.seed is not None:
        torch.manual_seed(config.seed)
    weights = prepare_weights(model, weights, mesh.device)
    config = fit_config(
        model, config, mesh.device, mesh.dp
    )  # before the model is moved: "auto" ratio, refusal
    model, pipeline = stage_chunks(on_device(model, mesh.device), config)
    check_context_parallel(config, mesh, model, pipeline)
    return Engine(
        model, config, mesh, optimizer, lr_scheduler, model_parameters, pipeline, weights, units
    )


def config_and_mesh(
    model, config, mesh: ParallelMesh | None, config_facts: dict
) -> tuple[PlaitConfig, ParallelMesh]:
    """The resolved ``PlaitConfig`` and the mesh (built from the config's tp/pp/cp sizes when ``mesh`` is None,
    after the ranks agree on the config and model). Raises ConfigError: the config's tp/pp differ from the
    mesh's, or a mesh that does not cover the world."""
    check_mesh_covers_world(mesh)
    hidden = getattr(
        getattr(model, "config", None), "hidden_size", None
    )  # a Hugging Face model's, or plait's
    config_facts.setdefault("model_hidden_size", hidden)
    if mesh is None:
        raw = (
            config
            if isinstance(config, PlaitConfig)
            else load_config(
                config,
                world_size=dist.get_world_size() if dist.is_initialized() else 1,
                **config_facts,
            )
        )
        check_ranks_agree(raw, model, None)  # before the mesh: every rank builds it from its config
        mesh = ParallelMesh(
            tp=raw.tensor_parallel.size, pp=raw.pipeline.size, cp=raw.context_parallel.size
        )
    if not isinstance(config, PlaitConfig):
        config = load_config(config, dp_size=mesh.dp, **config_facts)
    if config.tensor_parallel.size != mesh.tp or config.pipeline.size != mesh.pp:
        raise ConfigError(
            f"config asks for tensor_parallel.size={config.tensor_parallel.size}, pipeline.size="
            f"{config.pipeline.size} but the mesh has tp={mesh.tp}, pp={mesh.pp}; make them agree"
        )
    return config, mesh


def stage_chunks(model, config: PlaitConfig) -> tuple[nn.Module, PipelineParallel | None]:
    """A ``PipelineParallel`` -> ``(its stage modules as one ModuleList, it)`` after ``check_pipeline``; any
    other model -> ``(model, None)``."""
    if not isinstance(model, PipelineParallel):
        return model, None
    check_pipeline(model, config)
    return nn.ModuleList(model.stage_modules), model
