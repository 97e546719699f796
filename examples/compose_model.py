"""Compose your own architecture from plait layers and train it with tensor x pipeline parallelism.

    torchrun --nproc-per-node 4 examples/compose_model.py            # tp=2 x pp=2 on CPU
    torchrun --nproc-per-node 4 examples/compose_model.py --tp 1 --pp 4 --schedule gpipe

The model here is not one of the presets: a decoder whose blocks alternate between

- ``ParallelBlock`` (GPT-J / PaLM style): one norm, then attention and MLP side by side on the same
  input, both added to the residual: ``x + attn(norm(x)) + mlp(norm(x))``;
- plait's ``TransformerBlock`` (sequential pre-norm Llama block),

between plait's ``EmbeddingLayer`` and ``LMHead``. ``ComposedDecoder`` follows the conventions that
let the engine, the pipeline and checkpoints handle any such model:

1. layers live in ``self.layers``, an ``nn.ModuleDict`` keyed by *global* layer index (0 = embedding,
   1..L = blocks, L+1 = head), so a parameter has the same name in every layout and a pipeline stage
   builds only its own indices;
2. every layer is called as ``layer(hidden, batch)`` (``batch``: the micro-batch dict);
3. parameters come from plait layers (tensor-parallel shards declared, initializers set), and
   ``init_parameters(self, seed)`` draws each from (seed, name): identical weights at any tp/pp;
4. as a pipeline chunk it offers ``plait.parallel.pipeline.stage.StageChunk``: ``activation_shape(batch)`` (what
   it receives from the previous stage), ``tied_parameters()`` and ``tied_across_stages`` (nothing is
   tied here: the head has its own weight), besides ``config`` (a ``TransformerConfig``) and ``layers``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrain_common as common
import pretrain_layout as layout
import train_loop

from plait.data import DistributedBatches, TokenDataset
from plait.layers import MLP, Attention, EmbeddingLayer, LMHead, TransformerBlock
from plait.models import llama_config
from plait.layers.attention import scaled_init_std
from plait.layers.init import init_parameters
from plait.layers.norm import make_norm
from plait.parallel.random import RNGTracker
from plait.parallel.sharding import logical_numel


class ParallelBlock(nn.Module):
    """GPT-J's block (Wang & Komatsuzaki 2021; also PaLM, Chowdhery et al. 2022, Sec. 2):
    ``x + attn(norm(x)) + mlp(norm(x))`` on ``[b, s, h]`` (``[b, s/tp, h]`` with sequence parallelism)."""

    def __init__(self, c, *, group, sequence_parallel: bool, rng, device=None):
        super().__init__()
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device)  # noqa: C408
        out_std = scaled_init_std(c.init_std, c.num_layers)
        self.norm = make_norm(c.norm, c.hidden_size, c.norm_eps, c.bias, **kw)
        self.attn = Attention(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            causal=True,
            rope_theta=c.rope_theta,
            bias=c.bias,
            rng=rng,
            init_std=c.init_std,
            output_init_std=out_std,
            **kw,
        )
        self.mlp = MLP(
            c.hidden_size,
            c.ffn_hidden_size,
            c.activation,
            bias=c.bias,
            init_std=c.init_std,
            output_init_std=out_std,
            **kw,
        )

    def forward(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        h = self.norm(hidden)
        return (
            hidden
            + self.attn(h, batch.get("attention_mask"), batch.get("position_ids"))
            + self.mlp(h)
        )


class ComposedDecoder(nn.Module):
    """Embedding, blocks alternating ``ParallelBlock`` (odd index) and ``TransformerBlock`` (even),
    head. ``layers``: the global indices to build (a pipeline stage), default all."""

    plait_architecture = (
        "custom"  # its checkpoints must not claim to be a plain Llama (see model_io)
    )

    def __init__(
        self,
        config,
        mesh,
        *,
        layers=None,
        sequence_parallel: bool = False,
        seed: int = 1234,
        device=None,
    ):
        super().__init__()
        group = mesh.tp_group
        self.config, self.mesh = config, mesh
        self.sequence_parallel = sequence_parallel and mesh.tp > 1
        last = config.num_layers + 1
        rng_device = (
            torch.device("cpu") if device is None or torch.device(device).type == "meta" else device
        )
        self.rng = RNGTracker(seed + 100 * mesh.pp_rank, mesh.tp_rank, rng_device)
        kw = dict(group=group, sequence_parallel=self.sequence_parallel, device=device)  # noqa: C408
        self.layers = nn.ModuleDict()
        for i in range(last + 1) if layers is None else layers:
            if i == 0:
                layer = EmbeddingLayer(config, rng=self.rng, **kw)
            elif i == last:
                layer = LMHead(config, **kw)
            elif i % 2:
                layer = ParallelBlock(config, rng=self.rng, **kw)
            else:
                layer = TransformerBlock(config, rng=self.rng, **kw)
            self.layers[str(i)] = layer
        init_parameters(self, seed)

    @property
    def has_head(self) -> bool:
        return str(self.config.num_layers + 1) in self.layers

    tied_across_stages = False  # the head's weight is its own (llama_config does not tie)

    def tied_parameters(self) -> list:
        return []

    def activation_shape(self, batch: dict) -> tuple:
        """``(b, s, hidden)``, ``(b, s/tp, hidden)`` under sequence parallelism."""
        b, s = batch["input_ids"].shape[:2]
        return (b, s // self.mesh.tp if self.sequence_parallel else s, self.config.hidden_size)

    def forward(
        self, input_ids=None, labels=None, attention_mask=None, position_ids=None, hidden=None, **_
    ):
        batch = {
            k: v
            for k, v in {
                "input_ids": input_ids,
                "labels": labels,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
            }.items()
            if v is not None
        }
        for layer in self.layers.values():
            hidden = layer(hidden, batch)
        return hidden


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=6, help="blocks (alternating parallel / sequential)"
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    layout.add_parallel_args(parser, "pretrain_gpt.json")
    parser.set_defaults(steps=100, eval_every=25, save_every=50)
    args = parser.parse_args(argv)
    args.data, args.tokenizer = None, None

    # Llama-style pieces (RMSNorm, RoPE, SwiGLU, GQA), untied head, vocabulary of the bundled BPE.
    arch = llama_config(
        vocab_size=8192,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=int(2.75 * args.hidden),
        max_position_embeddings=args.seq_len,
    )
    info, mesh, cfg, _ = layout.setup(args, arch.hidden_size)
    rank0 = info.rank == 0
    out_dir = Path(args.out_dir)
    sp = cfg.tensor_parallel.sequence_parallel

    def chunk(layers):
        return ComposedDecoder(
            arch, mesh, layers=layers, sequence_parallel=sp, seed=args.seed, device=mesh.device
        )

    engine = train_loop.build_engine(args, mesh, cfg, arch, chunk_factory=chunk)
    whole = ComposedDecoder(arch, mesh, device="meta")  # all layers, nothing allocated
    params = logical_numel(whole)
    progress = common.Progress(
        out_dir / "metrics.jsonl",
        rank0,
        mesh.world_size,
        mesh.device,
        common.flops_per_token(params, arch.num_layers, arch.hidden_size, args.seq_len),
        common.peak_flops(mesh.device, args.peak_tflops),
    )
    tokens, _ = common.token_file(args, out_dir, rank0)
    micro = cfg.train_micro_batch_size_per_gpu
    to_device = lambda b: {k: v.to(mesh.device) for k, v in b.items()}
    train = TokenDataset(tokens, args.seq_len, "train", 0.02)
    val = TokenDataset(tokens, args.seq_len, "val", 0.02)
    loop = common.EpochLoop(
        DistributedBatches(train, micro, mesh.dp_rank, mesh.dp, seed=args.seed), to_device
    )
    engine.data_loader = loop
    kinds = ["parallel" if i % 2 else "sequential" for i in range(1, arch.num_layers + 1)]
    progress.say(
        f"plait compose_model: {params / 1e6:.2f}M parameters, {arch.num_layers} blocks {kinds}, hidden {arch.hidden_size}, "
        f"tp={mesh.tp} x pp={mesh.pp} x cp={mesh.cp} x dp={mesh.dp}, schedule {cfg.pipeline.schedule}, "
        f"{layout.zero_desc(cfg)}"
    )
    train_loop.run(
        args,
        engine,
        loop,
        lambda: common.EpochLoop(
            DistributedBatches(
                val,
                common.validation_micro_batch(len(val), micro, mesh.dp),
                mesh.dp_rank,
                mesh.dp,
                shuffle=False,
                drop_last=True,
            ),
            to_device,
        ),
        progress,
        out_dir / "checkpoints",
        cfg.train_batch_size * args.seq_len,
        rank0,
    )
    progress.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
