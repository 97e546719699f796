"""Pretraining data: the bundled English corpus and tokenizer, token files, samples, batches, MLM masks.

Pipeline::

    path = build_token_file(["my.txt"], tokenizer_path, "my.bin")        # or bundled_token_file()
    train = TokenDataset(path, seq_len=256, split="train", val_fraction=0.01)
    loader = DistributedBatches(train, micro_batch_size=8, dp_rank=mesh_dp_rank, dp_size=dp, seed=1234)
    for batch in loader:  # {"input_ids": [8, 256], "labels": [8, 256]} int64
        ...
    ckpt["data"] = loader.state_dict()                                    # plain ints

For BERT, ``mask_tokens(batch["input_ids"], mask_id, vocab_size, special_ids)`` gives the MLM
inputs and labels.
"""

from plait.data.bundled import (
    bundled_corpus_path,
    bundled_data_dir,
    bundled_tokenizer_path,
    load_bundled_text,
)
from plait.data.dataset import TokenDataset
from plait.data.masking import IGNORE_INDEX, mask_tokens
from plait.data.sampler import DistributedBatches, epoch_permutation
from plait.data.token_file import build_token_file, bundled_token_file, load_tokens, read_token_meta

__all__ = [
    "IGNORE_INDEX",
    "DistributedBatches",
    "TokenDataset",
    "build_token_file",
    "bundled_corpus_path",
    "bundled_data_dir",
    "bundled_token_file",
    "bundled_tokenizer_path",
    "epoch_permutation",
    "load_bundled_text",
    "load_tokens",
    "mask_tokens",
    "read_token_meta",
]
