"""``engine.save_16bit_model``: the whole model's weights in its compute dtype as one file, written by
global rank 0 (DeepSpeed's ``save_16bit_model``): ``pytorch_model.bin`` (``torch.save`` of the state dict)
by default, or safetensors when the file name ends in ``.safetensors``. Loadable with
``model.load_state_dict`` and by Hugging Face ``from_pretrained`` from a directory that also holds the
model's ``config.json``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from plait.checkpoint.contract import Checkpointable

log = logging.getLogger("plait")


def save_16bit(
    engine: Checkpointable,
    save_dir,
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the consolidated weights of the engine's model to ``save_dir/save_filename``. Collective.

    Returns False without writing (as DeepSpeed does) under ZeRO-3 when
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is false; True otherwise.

    Raises:
        ValueError: tensor or pipeline parallelism (see ``gathered_state_dict``).
    """
    path = os.path.join(os.fspath(save_dir), save_filename)
    state = gathered_state_dict(engine, path, exclude_frozen_parameters)
    if state is False:
        return False
    if state is not None:
        os.makedirs(os.fspath(save_dir), exist_ok=True)
        _write(state, path)
    if dist.is_initialized():
        dist.barrier()
    return True


def gathered_state_dict(
    engine: Checkpointable, target: str, exclude_frozen_parameters: bool = False
):
    """The whole model's state dict in its compute dtype (CPU copies) on global rank 0, None on the other
    ranks, or False on every rank when ZeRO-3 may not gather at save (``stage3_gather_16bit_weights_on_
    model_save`` false; logged, naming ``target``). Collective. Used by ``save_16bit_model`` and
    ``plait.hf.Trainer.save_model``.

    Raises:
        ValueError: tensor, pipeline or expert parallelism (each rank holds part of every layer, only some
            layers or only some experts): save with ``save_checkpoint`` and consolidate with ``plait convert``.
    """
    mesh = engine.mesh
    if mesh.tp > 1 or mesh.pp > 1 or mesh.ep > 1:
        raise ValueError(
            f"a consolidated model needs whole layers, but tp={mesh.tp}, pp={mesh.pp}, ep={mesh.ep}; "
            "use engine.save_checkpoint and `plait convert` to consolidate"
        )
    if not engine.gathers_16bit_on_save:
        log.warning(
            "did not save %s: zero_optimization.stage3_gather_16bit_weights_on_model_save is false "
            "(set it true to gather the ZeRO-3 shards at save)",
            target,
        )
        return False
    state = None
    with engine.optimizer.gathered_parameters():
        if mesh.global_rank == 0:
            (model,) = engine.model_chunks()  # pp = 1: the one model
            frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
            state = {
                k: v.detach().to("cpu", copy=True)
                for k, v in model.state_dict().items()
                if not (exclude_frozen_parameters and k in frozen)
            }
    return state


def _write(state: dict, path: str) -> None:
    """Write atomically: a crash mid-write leaves any earlier file at ``path`` whole."""
    tmp = path + ".tmp"
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        seen, unique = set(), {}
        for (
            k,
            v,
        ) in state.items():  # tied weights: safetensors refuses shared storage; keep the first
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            if key not in seen:
                seen.add(key)
                unique[k] = v.contiguous()
        save_file(unique, tmp, metadata={"format": "pt"})
    else:
        torch.save(state, tmp)
    os.replace(tmp, path)
