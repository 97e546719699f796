"""Fixed-length language-model samples cut from a flat token file, with a contiguous train/val split."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from plait.data.token_file import load_tokens, read_token_meta

SPLITS = ("train", "val")


class TokenDataset:
    """Next-token-prediction samples ``(input_ids [seq_len], labels [seq_len])`` from a token file.

    Split: the stream of ``n`` tokens is cut once, contiguously: validation is the last
    ``ceil(n * val_fraction)`` tokens, training everything before (no token is in both). Within a
    split of ``m`` tokens starting at ``base`` there are ``(m - 1) // seq_len`` samples::

        window_i = tokens[base + i*seq_len : base + i*seq_len + seq_len + 1]
        input_ids, labels = window_i[:-1], window_i[1:]       # int64 tensors [seq_len]

    Consecutive windows share one token (the last label of sample i is the first input of sample
    i + 1), so the inputs of all samples tile the split without gaps; at most ``seq_len`` tokens at
    the split's end are unused.

    Args:
        path: token file (plait ``.bin`` with sidecar, ``.npy``, or raw ``.bin`` with ``dtype``).
        seq_len: tokens per sample (positive).
        split: "train" or "val".
        val_fraction: share of tokens held out for validation, in [0, 1).
        dtype: storage dtype of a raw ``.bin`` without sidecar.

    Raises ValueError for a bad split / seq_len / val_fraction, or when the chosen split has fewer
    than ``seq_len + 1`` tokens (the message gives the counts and what to change).

    The memory map is opened lazily in each process, so the dataset pickles cheaply (DataLoader
    workers, spawn).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        split: str = "train",
        val_fraction: float = 0.01,
        dtype: np.dtype | str | None = None,
    ):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; choose one of {SPLITS}")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be positive")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        self.path, self.seq_len, self.split, self.val_fraction, self._dtype = (
            path,
            seq_len,
            split,
            val_fraction,
            dtype,
        )
        self.meta = read_token_meta(path) if not str(path).endswith(".npy") else None
        self._tokens: np.ndarray | None = None
        n = int(self.tokens.size)
        n_val = math.ceil(n * val_fraction)
        self.num_total_tokens = n
        self.start, self.stop = (0, n - n_val) if split == "train" else (n - n_val, n)
        m = self.stop - self.start
        if m < seq_len + 1:
            raise ValueError(
                f"the {split} split of {path} has {m} tokens ({n} in all, val_fraction={val_fraction}) but one "
                f"sample needs seq_len + 1 = {seq_len + 1}: shorten seq_len, "
                + ("raise val_fraction" if split == "val" else "lower val_fraction")
                + " or add text"
            )
        self.num_samples = (m - 1) // seq_len

    @property
    def tokens(self) -> np.ndarray:
        """The whole token stream (both splits), memory-mapped: ``[num_total_tokens]``."""
        if self._tokens is None:
            self._tokens = load_tokens(self.path, self._dtype)
        return self._tokens

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return self.num_samples

    def window(self, i: int) -> np.ndarray:
        """Token window of sample ``i`` (``[seq_len + 1]``, storage dtype). Raises IndexError."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} {self.split} samples")
        i %= self.num_samples
        a = self.start + i * self.seq_len
        return np.asarray(self.tokens[a : a + self.seq_len + 1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, both int64 ``[seq_len]``, labels = inputs shifted left by one."""
        w = torch.from_numpy(self.window(int(i)).astype(np.int64))
        return w[:-1], w[1:]

    def get_batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked samples: ``(input_ids, labels)``, both int64 ``[len(indices), seq_len]``."""
        if len(indices) == 0:
            empty = torch.zeros(0, self.seq_len, dtype=torch.int64)
            return empty, empty.clone()
        w = torch.from_numpy(np.stack([self.window(int(i)) for i in indices]).astype(np.int64))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()
