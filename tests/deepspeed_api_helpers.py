"""What the DeepSpeed API tests share (test_deepspeed_api.py, test_deepspeed_api_ranks.py): a tiny unmodified
Hugging Face BERT, its batches, and the ds_config."""

import torch
import transformers


def bert():
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def batch(step, rank=0, n=2):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 128, (n, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def ds_config(stage=2, gas=1, **extra):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage},
        **extra,
    }
