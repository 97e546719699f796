"""The micro-batches ``plait.hf.Trainer`` trains on. When dp is the world (ZeRO data parallelism, what the
Trainer serves): transformers' own ``get_train_dataloader`` (its sampler seeded with ``args.data_seed`` or
``seed``, accelerate's sharding of batches over the ranks and its one-batch read-ahead), so data and RNG draws
are those of plain transformers. Otherwise a ``DistributedSampler`` over the dp ranks. On resume, the
micro-batches already trained are left out before anything is read or collated."""

from __future__ import annotations

import torch.distributed as dist
from accelerate import skip_first_batches
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from plait.hf import read_ahead
from plait.hf.loop_parts import Skip, is_datasets_dataset


def dp_is_world(engine) -> bool:
    """Whether the engine's dp ranks are all the processes."""
    return engine.mesh.dp == (dist.get_world_size() if dist.is_initialized() else 1)


def train_loader(trainer, engine):
    """(micro-batches of this dp rank, the object whose ``set_epoch`` reshuffles them, the collator's
    ``ReadAheadCollate`` or None) for ``trainer`` (a ``plait.hf.Trainer``) training ``engine``."""
    if not dp_is_world(engine):
        loader, sampler = dp_loader(trainer, engine)
        return loader, sampler, None
    collate = plain = trainer.data_collator
    if trainer.args.dataloader_num_workers == 0:
        collate = read_ahead.ReadAheadCollate(plain)
    trainer.data_collator = collate  # get_train_dataloader reads the collator from here
    try:
        loader = trainer.get_train_dataloader()
    finally:
        trainer.data_collator = plain
    return loader, loader, collate if collate is not plain else None


def skipping(trainer, loader, engine, skip: int):
    """``loader`` without its first ``skip`` micro-batches (already trained, on resume), left out before
    anything is read or collated (accelerate's ``skip_first_batches``, or ``Skip``)."""
    if not dp_is_world(engine):
        return dp_loader(trainer, engine, skip)[0]
    return skip_first_batches(loader, skip)


def dp_loader(trainer, engine, skip: int = 0) -> tuple[DataLoader, DistributedSampler]:
    """Micro-batches of this dp rank when dp is not the world: a ``DistributedSampler`` (seeded with
    ``args.seed``, reshuffled by ``set_epoch``) over the dataset with transformers' unused columns removed;
    the first ``skip`` micro-batches are left out before anything is read or collated."""
    args, data = trainer.args, trainer.train_dataset
    collate = trainer.data_collator
    if is_datasets_dataset(data) and args.remove_unused_columns:
        data = trainer._remove_unused_columns(data, description="training")
    else:
        collate = trainer._get_collator_with_removed_columns(collate, description="training")
    mesh = engine.mesh
    sampler = DistributedSampler(data, num_replicas=mesh.dp, rank=mesh.dp_rank, seed=args.seed)
    workers = args.dataloader_num_workers
    batches = BatchSampler(sampler, args.per_device_train_batch_size, args.dataloader_drop_last)
    loader = DataLoader(
        data,
        batch_sampler=Skip(batches, skip) if skip else batches,
        collate_fn=collate,
        num_workers=workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=bool(args.dataloader_persistent_workers and workers),
    )
    return loader, sampler
