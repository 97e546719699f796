"""The torchtitan arms of bench_compile.py and bench_float8.py: torchtitan 0.3's ``Trainer`` at a plait
preset's shape (bench_compile: llama-886m), offline, on synthetic tokens.

What runs is torchtitan's own training step (``Trainer.train_step``): its Llama 3 model (fused wqkv,
SwiGLU, complex RoPE at theta 10000, no scaling), its ``parallelize_llama`` (FSDP2 at world size 1 with
MixedPrecisionPolicy bf16 params / fp32 reduce, per-block ``torch.compile(fullgraph=True)``), its compiled
chunked cross-entropy (``ChunkedLossWrapper``, the Llama 3 recipes' default), fused AdamW (lr 1e-4, wd
0.1, betas 0.9/0.95, constant schedule), clipping 1.0, no activation checkpointing, and CUDA graphs over
forward+backward unless ``cuda_graphs=False``. Changed from the recipes: attention is
``ScaledDotProductAttention`` (causal, as the other arms; the recipes use FlexAttention with
document masks), the tokenizer and dataloader are synthetic (no Hugging Face assets, no download),
checkpointing, validation and metric loggers are off. torchtitan imports ``datasets`` and
``tensorboard`` at import time and uses neither here: where they are not installed, empty stand-ins
are put in ``sys.modules`` first, as is one for its expert-parallel Triton kernels where Triton is not
installed (a CPU torch). torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims``, which
torch 2.11 (the GPU image's) lacks; its default spmd_types backend builds one only over more than one
data-parallel rank (at one rank FSDP gets none), so where torch lacks it a stand-in that refuses to be built
is put there: more ranks then fail naming it. It is the only name that the loaded modules of torchtitan,
spmd_types, torchdata and torch_checkpointing import and torch 2.11 lacks (checked against 2.11's sources).
bench_float8 sets, through ``trainer_config``'s keywords, what is above left at
bench_compile's: gradient accumulation, activation checkpointing (torchtitan's full or selective) and
model converters (its float8 ``Float8LinearConverter``, see ``float8_converter``).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple


def _stand_in(name: str, **attrs):
    def absent(*_a, **_k):
        raise RuntimeError(f"{name} is not installed (bench_compile stand-in)")

    module = types.ModuleType(name)
    module.__dict__.update({k: (absent if v is None else v) for k, v in attrs.items()})
    sys.modules[name] = module


if importlib.util.find_spec("datasets") is None:
    _stand_in("datasets", Dataset=object, IterableDataset=object, load_dataset=None)
    _stand_in("datasets.distributed", split_dataset_by_node=None)
if importlib.util.find_spec("tensorboard") is None:
    _stand_in("torch.utils.tensorboard", SummaryWriter=None)
if (
    importlib.util.find_spec("triton") is None
):  # a CPU torch (--dry-run): EP's Triton kernels, unused
    _stand_in(
        "torchtitan.distributed.minimal_async_ep.kernels",
        **{
            f"{name}_kernel": None
            for name in (
                "copy_full_counts_to_peers",
                "copy_rows_to_peers",
                "expand_topk_grad",
                "fill_combine_metadata",
                "fill_dispatch_metadata",
                "invert_flat_indices",
                "reduce_topk_slots",
                "topk_scores_grad",
            )
        },
    )

import torch  # noqa: E402
import torch.distributed.fsdp as _fsdp  # noqa: E402

if not hasattr(_fsdp, "DataParallelMeshDims"):  # torch 2.11: see the module docstring

    class _AbsentMeshDims:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(
                f"torch {torch.__version__} has no DataParallelMeshDims: torchtitan over more than "
                "one data-parallel rank needs a newer torch (bench stand-in)"
            )

    _fsdp.DataParallelMeshDims = _AbsentMeshDims
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402


class SyntheticTokenizer(BaseTokenizer):
    """Knows only its vocabulary size: the data is token ids already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 32000

    def __init__(self, config: Config, **_runtime):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs):
        raise NotImplementedError("synthetic token ids only")

    def decode(self, *args, **kwargs):
        raise NotImplementedError("synthetic token ids only")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticLoader(BaseDataLoader):
    """Endless random token ids on the CPU, seeded per batch: ``({"input": ids}, labels)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 32000

    def __init__(self, config: Config, *, seq_len: int, local_batch_size: int, **_runtime):
        self.vocab_size, self.seq_len, self.micro = config.vocab_size, seq_len, local_batch_size

    def __iter__(self):
        i = 0
        while True:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, self.vocab_size, (self.micro, self.seq_len + 1), generator=g)
            yield {"input": ids[:, :-1]}, ids[:, 1:]
            i += 1

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def llama_config(cfg):
    """torchtitan's ``Llama3Model.Config`` at ``cfg``'s shape (any object with plait's
    TransformerConfig field names)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    import torchtitan.models.llama3 as tl  # its private layer builder and inits, pinned to 0.3
    from torchtitan.models.llama3 import Llama3Model

    h, heads = cfg.hidden_size, cfg.num_heads
    rope = ComplexRoPE.Config(
        dim=h // heads,
        max_seq_len=cfg.max_position_embeddings,
        theta=cfg.rope_theta,
        scaling="none",
    )
    layers = tl._build_llama3_layers(
        n_layers=cfg.num_layers,
        dim=h,
        n_heads=heads,
        n_kv_heads=cfg.num_kv_heads,
        hidden_dim=cfg.ffn_hidden_size,
        rope=rope,
        fuse_qkv=True,
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = cfg.norm_eps
    norm = RMSNorm.Config(normalized_shape=h, param_init=tl._NORM_INIT, eps=cfg.norm_eps)
    return Llama3Model.Config(
        dim=h,
        vocab_size=cfg.vocab_size,
        enable_weight_tying=cfg.tie_embeddings,
        norm=norm,
        layers=layers,
        tok_embeddings=Embedding.Config(
            num_embeddings=cfg.vocab_size, embedding_dim=h, param_init=tl._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(
            in_features=h, out_features=cfg.vocab_size, param_init=tl._output_linear_init(h)
        ),
    )


def float8_converter(recipe: str, *, compile_on: bool, emulate: bool, skip: tuple[str, ...]):
    """torchtitan's ``Float8LinearConverter.Config`` for ``recipe``, leaving out the linears whose
    name contains one of ``skip``. Raises ValueError naming the recipes this torchtitan offers (0.3.0:
    "rowwise", "rowwise_with_gw_hp"; tensorwise and its float8 FSDP all-gather were 0.2's)."""
    import dataclasses
    import typing

    from torchtitan.components.quantization import Float8LinearConverter

    field = next(
        f for f in dataclasses.fields(Float8LinearConverter.Config) if f.name == "recipe_name"
    )
    offered = typing.get_args(field.type)
    if recipe not in offered:
        raise ValueError(
            f"torchtitan {titan_version()} offers the float8 recipes {offered} "
            f"(Float8LinearConverter.Config.recipe_name), not {recipe!r}: drop its titan arm"
        )
    return Float8LinearConverter.Config(
        recipe_name=recipe,
        filter_fqns=list(skip),
        emulate=emulate,
        model_compile_enabled=compile_on,
    )


def titan_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torchtitan")


def trainer_config(
    cfg,
    *,
    micro: int,
    seq: int,
    steps: int,
    cuda_graphs: bool,
    compile_on: bool = True,
    gas: int = 1,
    world: int = 1,
    converters: tuple = (),
    activation_checkpoint: str | None = None,
    flavor: str = "llama-886m",
):
    """A ``Trainer.Config`` for ``steps`` steps of the benchmark's training setup (see the module
    docstring): ``gas`` micro-batches per step on each of ``world`` ranks, the model config through
    ``converters`` (torchtitan converter configs, e.g. ``float8_converter``'s) as its
    ``model_registry`` applies them, ``activation_checkpoint`` None, "full" or "selective" (every
    block); ``flavor``: a label."""
    import torchtitan.models.llama3 as tl
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.utils import validate_converter_order
    from torchtitan.trainer import Trainer

    from _common import BETAS, CLIP, LR, WEIGHT_DECAY

    ac = {None: None, "full": FullAC.Config, "selective": SelectiveAC.Config}[activation_checkpoint]
    model = llama_config(cfg)
    validate_converter_order(list(converters))
    for converter in converters:
        model = converter.build().convert(model)
    spec = replace(
        tl.model_registry("debugmodel"),
        flavor=flavor,
        model=model,
        state_dict_adapter=None,
    )
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path="",
        dump_folder=tempfile.mkdtemp(prefix="titan-"),
        tokenizer=SyntheticTokenizer.Config(vocab_size=cfg.vocab_size),
        dataloader=SyntheticLoader.Config(vocab_size=cfg.vocab_size),
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size)
        ),
        optimizer=default_adamw(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),
        training=TrainingConfig(
            local_batch_size=micro,
            global_batch_size=micro * gas * world if gas > 1 else -1,
            seq_len=seq,
            steps=steps,
            max_norm=CLIP,
            disable_cuda_graphs=not cuda_graphs,
        ),
        metrics=MetricsProcessor.Config(log_freq=max(1, steps - 1)),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=ac and ac(),
        compile=CompileConfig(enable=compile_on, components=["model", "loss"]),
    )


class TitanRun(NamedTuple):
    """``step(i, probe=None) -> loss or None``; ``parts() -> bytes by kind``; the model's parameter
    count; the (parallelized) model."""

    step: Callable
    parts: Callable
    n_params: int
    model: torch.nn.Module


def make_titan(cfg, *, micro: int, seq: int, steps: int, cuda_graphs: bool, **setup) -> TitanRun:
    """torchtitan's Trainer for ``steps`` steps (``setup``: ``trainer_config``'s other keywords).
    Step ``steps - 1`` (1-based) returns torchtitan's logged loss; the others return None (no host
    sync)."""
    from torchtitan.trainer import Trainer

    from _memory import tensor_parts

    trainer = Trainer(
        trainer_config(cfg, micro=micro, seq=seq, steps=steps, cuda_graphs=cuda_graphs, **setup)
    )
    model, optimizers = trainer.model_parts[0], trainer.optimizers
    n_params = sum(p.numel() for p in model.parameters())
    data = trainer.batch_generator(trainer.dataloader)
    seen, probe_box, optimizer_step = {}, [None], optimizers.step
    log = trainer.metrics_processor.log

    def log_loss(step, global_avg_loss, *args, **kwargs):
        seen[step] = global_avg_loss
        return log(step, global_avg_loss, *args, **kwargs)

    def step_with_probe(*args, **kwargs):
        if probe_box[0] is not None:
            probe_box[0]()
        return optimizer_step(*args, **kwargs)

    trainer.metrics_processor.log, optimizers.step = log_loss, step_with_probe

    def step(i, probe=None):
        probe_box[0] = probe
        trainer.step += 1
        trainer.gc_handler.run(trainer.step)
        trainer.train_step(data)
        return seen.get(trainer.step)

    return TitanRun(
        step, lambda: tensor_parts(model.parameters(), optimizers.optimizers), n_params, model
    )
