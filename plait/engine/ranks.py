"""What ``plait.initialize`` settles among the ranks before it trains: that they agree, and how long they
wait for each other.

* Agreement: every rank must hold the same resolved config, the same model config and, among the ranks
  that keep replicas of the same parameters (a ``dp_cp`` group), the same parameter names, shapes, dtypes
  and trainable flags; a rank started with another lr, ZeRO stage or accumulation count would otherwise
  train a silently mixed model or abort in a collective naming nothing (``plait.parallel.agree``).
* Timeouts: ``comm.startup_timeout_s`` holds on every group of the mesh from ``initialize`` on (a rank that
  stalls before the first step is caught after it), ``comm.timeout_s`` from the first applied step
  (``plait.engine.guard``). A timeout the script passed to ``init_distributed`` holds for the whole run
  instead, and the config says so (``comm`` replaced, logged once).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from plait.config import ConfigError, PlaitConfig
from plait.config.schema import CommConfig
from plait.parallel.agree import agree, flatten
from plait.parallel.launch import explicit_timeout_s, set_collective_timeout
from plait.parallel.mesh import GROUP_NAMES, ParallelMesh
from plait.parallel.pipeline.parallel import PipelineParallel

SAME_EVERYWHERE = (
    "start every rank with the same config and the same model (the same ds_config file, "
    "script arguments and model code on every node)"
)


def check_mesh_covers_world(mesh: ParallelMesh | None) -> None:
    """Raise ``ConfigError`` when ``mesh`` was made before the process group started (it then spans one rank
    and every rank would train alone, silently): its tp x pp x cp x dp must be the world size."""
    if mesh is None or not dist.is_initialized() or mesh.world_size == dist.get_world_size():
        return
    raise ConfigError(
        f"the mesh spans {mesh.world_size} rank(s) (tp x pp x cp x dp = {mesh.tp} x {mesh.pp} x {mesh.cp} x "
        f"{mesh.dp}) but this job has {dist.get_world_size()} ranks: it was made before the process group "
        "started, and every rank would train alone. Call plait.parallel.init_distributed() before "
        "ParallelMesh(...) (as examples/pretrain_layout.py does), or pass no mesh to plait.initialize"
    )


def check_ranks_agree(config: PlaitConfig, model, mesh: ParallelMesh | None) -> None:
    """Collective over the world: raise ``ConfigError`` on every rank, naming the keys, values and ranks,
    unless all ranks hold the same ``config.to_dict()`` and model config and, with a ``mesh``, each of its
    ``dp_cp`` groups the same parameters. Without a mesh (before ``initialize`` builds one from the config:
    ranks asking for other tp/pp/cp sizes would build meshes that do not fit) the parameters are not compared."""
    if not dist.is_initialized():
        return
    facts = flatten(config.to_dict())
    facts.update(flatten(model_config(model), "model"))
    if mesh is None:
        agree(facts, SAME_EVERYWHERE, error=ConfigError)
        return
    group = mesh.group("dp_cp")
    scope = tuple(dist.get_process_group_ranks(group)) if group is not None else (mesh.global_rank,)
    agree(facts, SAME_EVERYWHERE, scoped=parameter_facts(model), scope=scope, error=ConfigError)


def model_config(model) -> dict:
    """The model's config as a dict: plait's ``TransformerConfig`` (a dataclass) or a Hugging Face config's
    ``to_dict()`` without its private keys, paths and library version; {} for a model without one."""
    if isinstance(model, PipelineParallel):
        model = model.stage_modules[0]
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if hasattr(config, "to_dict"):
        return {
            k: v
            for k, v in config.to_dict().items()
            if not k.startswith("_") and k not in ("transformers_version", "name_or_path")
        }
    return {}


def parameter_facts(model) -> dict[str, str]:
    """``{"parameter <name>": "[out, in] float32 trainable"}`` for each of this rank's parameters (the
    device is left out: it differs per rank by design)."""
    if isinstance(model, PipelineParallel):
        model = nn.ModuleList(model.stage_modules)
    return {
        f"parameter {name}": f"{list(p.shape)} {str(p.dtype).removeprefix('torch.')} "
        f"{'trainable' if p.requires_grad else 'frozen'}"
        for name, p in model.named_parameters()
    }


def timeout_groups(mesh: ParallelMesh, pipeline=None) -> tuple:
    """Every process group of the mesh and the pipeline's tied-weights group (None entries possible)."""
    return tuple(
        {mesh.group(name) for name in GROUP_NAMES} | {getattr(pipeline, "tied_group", None)}
    )


def with_script_timeout(config: PlaitConfig, rank: int) -> PlaitConfig:
    """``config`` with ``comm`` set to the timeout the script passed to ``init_distributed`` (both keys),
    when it passed one; logged once (rank 0) when that replaces other values."""
    seconds = explicit_timeout_s()
    if seconds is None:
        return config
    comm = config.comm
    if rank == 0 and (comm.timeout_s, comm.startup_timeout_s) != (seconds, seconds):
        logging.getLogger("plait").warning(
            "comm: collectives keep the %g s timeout the script passed to init_distributed for the whole run; "
            "comm.timeout_s (%g s) and comm.startup_timeout_s (%g s) are not applied (call init_distributed "
            "without a timeout to use them)",
            seconds,
            comm.timeout_s,
            comm.startup_timeout_s,
        )
    return dataclasses.replace(
        config, comm=CommConfig(timeout_s=seconds, startup_timeout_s=seconds)
    )


def start_up(config: PlaitConfig, model, mesh: ParallelMesh) -> PlaitConfig:
    """The start of a multi-rank run, before any other collective of ``initialize``: apply the script's
    timeout (``with_script_timeout``), put every group of the mesh under ``comm.startup_timeout_s``, then
    check that the ranks agree. Returns the config the engine runs with.

    Raises:
        ConfigError: the ranks disagree (every rank raises the same message).
    """
    config = with_script_timeout(config, mesh.global_rank)
    pipeline = model if isinstance(model, PipelineParallel) else None
    set_collective_timeout(config.comm.startup_timeout_s, timeout_groups(mesh, pipeline))
    check_ranks_agree(config, model, mesh)
    return config


def dp_mean(loss: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """The mean of a scalar over the data-parallel (x context-parallel) ranks (collective; the value
    itself at dp x cp 1), as a float32 tensor of shape ``[]`` on the mesh's device (no host sync)."""
    group, size = mesh.group("dp_cp"), mesh.size("dp_cp")
    if group is None or size == 1:
        return loss
    out = loss.detach().to(mesh.device, torch.float32).reshape(1)
    dist.all_reduce(out, group=group)
    return (out / size).reshape(())
