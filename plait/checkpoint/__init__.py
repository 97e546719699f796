"""Layout-free sharded checkpoints: safetensors slices of logical tensors plus a JSON index.

Save collectively with ``save`` / ``CheckpointWriter`` (each rank passes the ``ShardItem`` boxes
it owns); read any box of any tensor with ``CheckpointReader``, whatever layout wrote it. The
on-disk format is described in ``plait/checkpoint/FORMAT.md``. ``model_io`` / ``model_load`` save and load a
model's weights in any tp/pp/dp layout; ``convert`` goes to and from Hugging Face (``plait convert``);
``engine_io`` is what ``Engine.save_checkpoint`` / ``load_checkpoint`` run, over the ``Checkpointable``
Protocol (``contract``) that the engine implements; ``optimizer_io`` stores ZeRO's flat pieces as boxes.
"""

from plait.checkpoint.boxes import flat_range_boxes
from plait.checkpoint.contract import (
    Checkpointable,
    RngState,
    ShardedOptimizer,
    TrainerState,
    WriterSlot,
)
from plait.checkpoint.dirs import list_tags, prune, read_latest
from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.index import model_fingerprint, optimizer_key, split_optimizer_key
from plait.checkpoint.meta import tensor_from_json, tensor_to_json
from plait.checkpoint.reader import CheckpointReader, ModelCheck
from plait.checkpoint.tp import read_tp_shard, tp_box, tp_shard_item
from plait.checkpoint.writer import CheckpointWriter, SaveHandle, ShardItem, save
from plait.checkpoint.model_io import save_model_weights
from plait.checkpoint.model_load import LoadReport, load_model_weights
from plait.checkpoint.convert import consolidate, from_hf, inspect, to_hf

__all__ = [
    "Checkpointable",
    "RngState",
    "ShardedOptimizer",
    "TrainerState",
    "WriterSlot",
    "CheckpointError",
    "CheckpointReader",
    "CheckpointWriter",
    "ModelCheck",
    "SaveHandle",
    "ShardItem",
    "flat_range_boxes",
    "list_tags",
    "model_fingerprint",
    "optimizer_key",
    "prune",
    "read_latest",
    "read_tp_shard",
    "save",
    "split_optimizer_key",
    "tensor_from_json",
    "tensor_to_json",
    "tp_box",
    "tp_shard_item",
    "LoadReport",
    "load_model_weights",
    "save_model_weights",
    "consolidate",
    "from_hf",
    "inspect",
    "to_hf",
]
