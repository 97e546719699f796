"""``TransformerConfig``: the architecture of a decoder or encoder.

Every field the shared layers build from is here; each family (``plait.models``: ``preset``,
``gpt2_config``, ``llama_config``, ``bert_config``, ...) fills them. ``plait.layers`` never imports
``plait.models``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: Integer size fields of ``TransformerConfig`` and their least value (checked at construction, by name).
SIZE_FIELDS = {
    "vocab_size": 1,
    "hidden_size": 1,
    "num_layers": 1,
    "num_heads": 1,
    "num_kv_heads": 1,
    "ffn_hidden_size": 1,
    "max_position_embeddings": 1,
    "type_vocab_size": 0,
    "vocab_alignment": 1,
    "num_experts": 0,
    "moe_top_k": 0,
    "moe_ffn_hidden_size": 1,
    "moe_shared_ffn_hidden_size": 0,
}


@dataclass
class TransformerConfig:
    """Architecture hyper-parameters (sizes in elements; no parallel layout here).

    ``arch`` names the model family (``plait.models``), whose factory sets the wiring: "gpt2" (learned
    positions, pre-norm LayerNorm, GELU-tanh, biases, tied head), "llama" (RoPE, pre-norm RMSNorm,
    SwiGLU, no biases, GQA, tied or untied head) or "bert" (learned + token-type positions,
    embedding LayerNorm, post-norm blocks, GELU, bidirectional attention, MLM head tied to the
    embedding). Use ``gpt2_config``, ``llama_config`` and ``bert_config`` for the family defaults.
    Layers a family adds around the shared blocks: ``embedding_norm`` (a norm after the summed embeddings),
    ``head_transform`` (a dense ``[h, h]`` layer + GELU before the head's norm) and ``head_bias`` (an output
    bias ``[V]``): BERT's embedding LayerNorm and MLM head.

    ``fused_loss_chunk_tokens`` (tokens, default 0) changes only how the head computes its loss when
    labels are given: 0 computes the logits ``[b, s, V_pad/tp]`` and then the cross entropy (the
    float32 logits and softmax live until backward); a positive value fuses the head's matmul with
    the loss over chunks of that many tokens (``plait.layers.fused_cross_entropy``), so at most one
    chunk's float32 logits exist at a time. Same loss and gradients up to float rounding. Without
    labels the head returns the logits either way.

    ``head_labeled_only`` (default False): with labels given, the head projects and scores only the positions
    whose label is not -100 (``[n, h]`` rows instead of ``[b, s, h]``), as BERT's pretraining code gathers the
    masked positions (Devlin et al., 2019, ``masked_lm_positions``): the same loss and gradients, and for MLM
    (15% of positions labeled) about a sixth of the head's ``[.., V]`` matmuls and softmax. The row count then
    depends on the data, which CUDA-graph capture and ``torch.compile(fullgraph=True)`` cannot take.

    ``mlp_chunk_tokens`` (positions, default 0) runs each block's MLP over tiles of that many sequence
    positions, keeping only its input for backward and recomputing each tile there
    (``plait.layers.tiled``, Arctic Long Sequence Training's TiledMLP): for long sequences, whose
    ``[b, s, ffn/tp]`` activations would otherwise be kept per block. Same results up to float rounding.

    ``fused_projections`` (default False) runs q/k/v as one column-parallel matmul and SwiGLU's gate and
    up as another (``Attention.qkv_proj``, ``MLP.gate_up_proj``); False keeps one layer per projection.
    The logical weights, their names in checkpoints and the computation (up to float rounding) are the
    same either way, so a checkpoint of one loads into the other.

    ``num_experts`` > 0 makes every block's MLP a mixture of experts (``plait.layers.MoE``: ``moe_top_k``
    SwiGLU experts of width ``moe_ffn_hidden_size``, default ``ffn_hidden_size``, per token; the ``moe_*``
    fields are its arguments); each block's weighted balance and z losses join the gradient, not the returned
    loss (``TransformerModel``).

    ``head_dim`` (elements, default ``hidden_size // num_heads``): each attention head's width; q/k/v
    project to ``num_heads`` / ``num_kv_heads`` heads of it (Qwen3-30B-A3B: hidden 2048, 32 heads of 128).
    ``qk_norm`` (default False) applies an RMSNorm over each head's ``head_dim`` to q and k before RoPE, one
    weight ``[head_dim]`` for all heads of q and one for k (Qwen3; ``Attention``).

    Raises:
        ValueError: a size that is not an int in range (:data:`SIZE_FIELDS`, named), sizes that
            do not divide (names both numbers), a ``head_dim`` < 1, or a negative ``fused_loss_chunk_tokens`` or
            ``mlp_chunk_tokens``.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    max_position_embeddings: int = 1024
    activation: str = "gelu_tanh"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    rope_theta: float | None = None
    bias: bool = True
    tie_embeddings: bool = True
    causal: bool = True
    post_norm: bool = False
    type_vocab_size: int = 0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    vocab_alignment: int = 128
    label_smoothing: float = 0.0
    fused_loss_chunk_tokens: int = 0
    mlp_chunk_tokens: int = 0
    fused_projections: bool = False
    head_dim: int | None = None
    qk_norm: bool = False
    num_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_ffn_hidden_size: int = 0
    moe_router_order: str = "softmax_topk"
    moe_normalize_topk: bool = True
    moe_capacity_factor: float | None = None
    moe_balance_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0
    embedding_norm: bool = False
    head_transform: bool = False
    head_bias: bool = False
    head_labeled_only: bool = False

    def __post_init__(self):
        self._check_sizes()
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.num_experts < 0 or self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be >= 0 (0: dense MLPs), and moe_top_k "
                f"({self.moe_top_k}) in [1, num_experts] when experts are used"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                    f"set head_dim to use heads of another width"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if (
            isinstance(self.head_dim, bool)
            or not isinstance(self.head_dim, int)
            or self.head_dim < 1
        ):
            raise ValueError(
                f"head_dim must be an int >= 1 (None: hidden_size // num_heads), got {self.head_dim!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not divisible by num_kv_heads ({self.num_kv_heads})"
            )
        for name, what in (
            (
                "fused_loss_chunk_tokens",
                "unfused loss; > 0: tokens per chunk of the fused head + loss, e.g. 1024",
            ),
            ("mlp_chunk_tokens", "the MLP over the whole sequence; > 0: positions per MLP tile"),
        ):
            chunk = getattr(self, name)
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: {what}), got {chunk!r}")

    def _check_sizes(self) -> None:
        """ValueError naming the first size field (:data:`SIZE_FIELDS`) that is not an int >= its least value;
        fields still None (derived) are skipped. Runs before anything divides by or allocates from them."""
        for name, least in SIZE_FIELDS.items():
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < least
            ):
                raise ValueError(
                    f"TransformerConfig {name} must be an int >= {least}, got {value!r}"
                )

    def num_parameters(self) -> int:
        """Logical parameter count (no vocabulary padding; tied weights counted once), from the shapes of the
        embedding, one block and the head (every block has the same): fast at any ``num_layers``."""
        import math

        from plait.layers.model import logical_shapes  # local: the model imports this module

        last = self.num_layers + 1
        per_layer = dict.fromkeys((0, 1, last), 0)
        for name, shape in logical_shapes(self, layers=(0, 1, last)).items():
            per_layer[int(name.split(".")[1])] += math.prod(shape)
        return per_layer[0] + self.num_layers * per_layer[1] + per_layer[last]

    def num_active_parameters(self) -> int:
        """Parameters each token passes through: ``num_parameters()`` less, in every block, the
        ``num_experts - moe_top_k`` SwiGLU experts (``3 x hidden x moe_ffn`` each) it is not routed to; the count
        a mixture of experts' MFU is taken on (all parameters for a dense model)."""
        unused = (
            (self.num_experts - self.moe_top_k) * 3 * self.hidden_size * self.moe_ffn_hidden_size
        )
        return self.num_parameters() - (self.num_layers * unused if self.num_experts else 0)

    def replace(self, **changes) -> "TransformerConfig":
        """A copy with ``changes``; fields still at their derived default (``num_kv_heads ==
        num_heads``, ``ffn_hidden_size == 4 * hidden_size``, ``head_dim == hidden_size // num_heads``) follow
        the changed sizes."""
        if "head_dim" not in changes and self.head_dim * self.num_heads == self.hidden_size:
            changes["head_dim"] = None
        if "num_kv_heads" not in changes and self.num_kv_heads == self.num_heads:
            changes["num_kv_heads"] = None
        if "ffn_hidden_size" not in changes and self.ffn_hidden_size == 4 * self.hidden_size:
            changes["ffn_hidden_size"] = None
        if (
            "moe_ffn_hidden_size" not in changes
            and self.moe_ffn_hidden_size == self.ffn_hidden_size
        ):
            changes["moe_ffn_hidden_size"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
