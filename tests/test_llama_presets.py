"""plait's Llama presets against transformers' ``LlamaForCausalLM`` of the same shape (built on the meta
device: no weights allocated, no download)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from plait.checkpoint.hf import config_from_hf, config_to_hf
from plait.models import preset


def test_llama3_8b_preset_has_meta_llama_3_8b_shape_and_parameter_count():
    cfg = preset("llama3-8b")
    hf = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    hf_params = sum(p.numel() for p in model.parameters())
    assert cfg.num_parameters() == hf_params == 8_030_261_248  # "8B": Meta's model card
    assert config_from_hf(hf.to_dict()) == cfg  # the same shape, theta, eps and untied head
    assert config_from_hf(config_to_hf(cfg).to_dict()) == cfg
