"""The sizes in a Hugging Face ``config.json``, checked before anything is built from them.

A config from elsewhere may hold a negative vocabulary, a fractional head count or a hidden size of 10**9.
``check_hf_sizes`` refuses, naming the key, every size that is not a whole number in range, and a config
whose sizes imply far more weights than the folder's safetensors files hold (the weights a loader reads
come only from those files). It runs on the raw ``config.json`` of any model type, before plait maps it
or transformers builds a model, so nothing is allocated and no loop runs over a bogus layer count.
"""

from __future__ import annotations

from collections.abc import Mapping

#: config.json size keys (any model type uses some of them) and their least allowed value.
SIZE_KEYS = {
    "vocab_size": 1,
    "hidden_size": 1,
    "n_embd": 1,
    "d_model": 1,
    "num_hidden_layers": 1,
    "n_layer": 1,
    "num_layers": 1,
    "num_attention_heads": 1,
    "n_head": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "intermediate_size": 1,
    "n_inner": 1,
    "ffn_dim": 1,
    "d_ff": 1,
    "max_position_embeddings": 1,
    "n_positions": 1,
    "moe_intermediate_size": 1,
    "type_vocab_size": 0,
    "num_local_experts": 0,
    "num_experts": 0,
    "num_experts_per_tok": 0,
    "shared_expert_intermediate_size": 0,
}
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")

#: A config is refused when even at one byte per parameter its weights would need more than this many times
#: the bytes its weight files hold: room for models that share layers (ALBERT) or factorize the embedding,
#: which the lower bound below overcounts.
SLACK = 4


def _first(config: Mapping, keys: tuple[str, ...]) -> tuple[str, int] | None:
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    return None


def min_parameters(config: Mapping) -> int:
    """A lower bound on the parameters of a transformer with these config.json sizes: the embedding
    ``vocab x hidden`` plus, per layer, attention's query and output projections ``2 x hidden^2``."""
    hidden, layers = _first(config, HIDDEN_KEYS), _first(config, LAYER_KEYS)
    h = hidden[1] if hidden else 0
    return (config.get("vocab_size") or 0) * h + (layers[1] if layers else 0) * 2 * h * h


def check_hf_sizes(
    config: Mapping, where: str = "config.json", weight_bytes: int | None = None
) -> None:
    """Refuse the config.json dict ``config`` (read from ``where``) before anything is built from it.

    Args:
        weight_bytes: bytes of the safetensors files the weights will be read from (None: not checked).

    Raises:
        ValueError: a size key (:data:`SIZE_KEYS`) that is not a whole number >= its least value, e.g.
            ``config.json vocab_size=-5: must be a whole number >= 1``; or sizes whose weights, at one byte per
            parameter, need more than ``SLACK`` times ``weight_bytes`` (names the keys, the parameters and
            the bytes as float32).
    """
    for key, least in SIZE_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(
                f"{where} {key}={value!r}: must be a whole number >= {least}; fix the file (or pass "
                f"the right value as an override)"
            )
    params = min_parameters(config)
    if weight_bytes is not None and params > SLACK * weight_bytes:
        named = [k for k in (_first(config, HIDDEN_KEYS), _first(config, LAYER_KEYS)) if k]
        named += (
            [("vocab_size", config["vocab_size"])] if config.get("vocab_size") is not None else []
        )
        sizes = ", ".join(f"{k}={v}" for k, v in named)
        raise ValueError(
            f"{where} {sizes}: the model would need at least {params:.2e} parameters ({4 * params:.2e} "
            f"bytes of float32 weights), but its safetensors files hold {weight_bytes} bytes; fix "
            f"these keys, or use the config.json the weights were saved with"
        )
