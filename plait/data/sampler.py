"""Deterministic, resumable, data-parallel batching of a map-style dataset."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The global sample order of ``epoch``: a permutation of ``range(num_samples)`` (int64).

    Drawn with numpy's PCG64 seeded by ``SeedSequence([seed, epoch])``, so it depends only on
    (num_samples, seed, epoch): never on dp size, rank, process or call order.
    """
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).permutation(
        num_samples
    )


class DistributedBatches:
    """Micro-batches ``{"input_ids": [b, s], "labels": [b, s]}`` (int64) for one data-parallel rank.

    Each epoch ``e`` has one global order ``perm = epoch_permutation(N, seed, e)`` shared by all ranks; a
    step consumes the next ``G = micro_batch_size * dp_size`` samples of it, and dp rank ``r`` takes the
    ``r``-th block of ``micro_batch_size``, so the ranks' micro-batches of one step, concatenated, are the
    dp=1 order's. Tensor- and pipeline-parallel ranks of one replica pass the same dp rank and get identical
    batches. ``state_dict()`` is ``{"epoch", "position", "seed", "num_samples"}`` (plain ints; ``position``
    counts the epoch's global samples handed out); resuming continues at ``perm[position]`` at any new
    ``dp_size`` or ``micro_batch_size``. With ``drop_last=False`` a rank's final micro-batch may be short or
    empty (``[0, s]``) so that every rank runs the same number of steps. The order, resume and epoch-end
    rules in full: ``docs/data.md``.

    Iterating yields the rest of the current epoch; iterate again for the next epoch.

    Args:
        dataset: map-style dataset of ``(input_ids [s], labels [s])`` pairs; ``get_batch(indices)``
            is used when present (``TokenDataset`` has it).
        micro_batch_size: samples per rank per step (``b``).
        dp_rank, dp_size: this rank's data-parallel coordinate, ``0 <= dp_rank < dp_size``.
        seed: shuffle seed, the same on all ranks.
        drop_last: drop the epoch's last ``(N - position) % G`` samples (False: a last, short step).
        shuffle: False keeps the dataset order (``perm = arange(N)``), e.g. for evaluation.

    Raises ValueError for bad sizes or ranks, or if ``drop_last`` and ``N < G`` (no full step).
    """

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        drop_last: bool = True,
        shuffle: bool = True,
    ):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be positive")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}, dp_size={dp_size}: need 0 <= dp_rank < dp_size")
        if seed < 0:
            raise ValueError(f"seed={seed} must be non-negative")
        self.dataset, self.micro_batch_size, self.dp_rank, self.dp_size = (
            dataset,
            micro_batch_size,
            dp_rank,
            dp_size,
        )
        self.seed, self.drop_last, self.shuffle = seed, drop_last, shuffle
        self.num_samples = len(dataset)
        self.global_step_samples = micro_batch_size * dp_size
        if drop_last and self.num_samples < self.global_step_samples:
            raise ValueError(
                f"{self.num_samples} samples cannot fill one step of micro_batch_size {micro_batch_size} x "
                f"dp_size {dp_size} = {self.global_step_samples}: lower micro_batch_size, shorten seq_len, "
                f"add data, or pass drop_last=False"
            )
        self.epoch = 0
        self.position = 0
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def __len__(self) -> int:
        """Steps in one full epoch for this (micro_batch_size, dp_size)."""
        g = self.global_step_samples
        return self.num_samples // g if self.drop_last else -(-self.num_samples // g)

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            n = self.num_samples
            self._perm = (
                epoch_permutation(n, self.seed, self.epoch) if self.shuffle else np.arange(n)
            )
            self._perm_epoch = self.epoch
        return self._perm

    def _step_left(self) -> bool:
        left = self.num_samples - self.position
        return left >= self.global_step_samples if self.drop_last else left > 0

    def next_indices(self) -> np.ndarray | None:
        """Dataset indices of this rank's next micro-batch (``[<= b]``), advancing the position;
        None at the end of the epoch (which then moves on to the next epoch)."""
        if not self._step_left():
            self.epoch, self.position = self.epoch + 1, 0
            return None
        b = self.micro_batch_size
        start = self.position + self.dp_rank * b
        idx = self._order()[start : min(start + b, self.num_samples)]
        self.position = min(self.position + self.global_step_samples, self.num_samples)
        return idx

    def _fetch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        if hasattr(self.dataset, "get_batch"):
            x, y = self.dataset.get_batch(idx)
        elif len(idx):
            pairs = [self.dataset[int(i)] for i in idx]
            x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        else:
            x0, _ = self.dataset[0]
            x = torch.zeros((0, *x0.shape), dtype=x0.dtype)
            y = x.clone()
        return {"input_ids": x, "labels": y}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while (idx := self.next_indices()) is not None:
            yield self._fetch(idx)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed", "num_samples"}``: where the global stream stands."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from any dp_size / micro_batch_size with the same data and seed).

        Raises ValueError if the seed or sample count differ (other data, seq_len or split), or the
        epoch/position are out of range.
        """
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"state was saved with seed {state['seed']} but this loader has seed {self.seed}"
            )
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"state was saved over {state['num_samples']} samples but the dataset has {self.num_samples}: "
                f"resume with the same token file, seq_len, split and val_fraction"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise ValueError(
                f"epoch={epoch}, position={position}: need epoch >= 0, 0 <= position <= {self.num_samples}"
            )
        self.epoch, self.position = epoch, position
