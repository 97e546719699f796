"""Context parallelism in whole models and through the engine: each model (Llama, GPT-2, BERT) with its sequence
split over cp gloo ranks against one process on whole sequences, then ``plait.initialize`` with
``context_parallel`` (ZeRO over dp x cp, with tp, a pipeline, padded BERT, LAMB), and the refusals naming the fix.
Tolerances as tests/test_context_parallel.py's module docstring (the attention itself)."""

import pytest
import torch
import torch.distributed as dist

from helpers import rel_err
from plait.parallel import context as C
from plait.testing import run_distributed


# ---- whole models: the sequence split over cp ranks against one process --------------------------------
SEQ = 16


def model_batch(cfg):
    """Ids and labels ``[2, SEQ]`` with ignored labels (counted over all cp ranks); for a bidirectional model
    (BERT) also a padding mask: sequence 0 padded over its last 5 tokens (their labels ignored)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=g)
    labels[0, 3] = labels[1, 9] = -100
    batch = {"input_ids": ids, "labels": labels}
    if not cfg.causal:
        batch["attention_mask"] = torch.ones(2, SEQ, dtype=torch.long)
        batch["attention_mask"][0, SEQ - 5 :] = 0
        labels[0, SEQ - 5 :] = -100
    return batch


def model_config(arch):
    from plait.models import preset

    return preset(f"{arch}-tiny", num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)


def model_body(arch, method):
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh

    mesh = ParallelMesh(cp=dist.get_world_size())
    cfg = model_config(arch)
    model = TransformerModel(cfg, mesh, seed=3, cp_method=method)
    loss = model(
        **{k: C.shard_sequence(t, mesh.cp, mesh.cp_rank) for k, t in model_batch(cfg).items()}
    )
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "arch, method, cp",
    [
        ("llama", "ring", 2),
        ("llama", "all_to_all", 2),
        ("gpt2", "ring", 4),
        ("bert", "ring", 2),
        ("bert", "all_to_all", 4),
    ],
)
def test_model_with_context_parallel_matches_one_process(arch, method, cp):
    """Llama (RoPE, GQA), GPT-2 (learned positions) and BERT (bidirectional, padded): each cp rank's loss and the
    mean over cp ranks of each parameter gradient (what averaging over dp x cp takes) equal one process on whole
    sequences, with ignored labels, to 1e-5 (module docstring). The key projection's bias has a zero
    gradient in exact arithmetic (softmax ignores a constant added to all of a query's scores), so its
    rounding noise is measured against a norm floor of 1e-4 (the other gradients' norms are 1e-2 to 1)."""
    from plait.layers import TransformerModel

    cfg = model_config(arch)
    ref = TransformerModel(cfg, None, seed=3)
    loss = ref(**model_batch(cfg))
    loss.backward()
    results = run_distributed(model_body, cp, arch, method)
    for got_loss, _ in results:  # every cp rank reports the whole sequences' mean loss
        assert abs(got_loss - loss.item()) <= 1e-5 * abs(loss.item())
    for name, p in ref.named_parameters():
        grad = sum(r[1][name] for r in results) / cp
        err = rel_err(grad, p.grad, floor=1e-4)
        assert err <= 1e-5, (name, err)


# ---- through the engine: ZeRO over the dp x cp ranks, the engine sharding each batch --------------------
def bert_tiny():
    """test_engine's sizes for BERT (4 heads: all-to-all over tp 2 x cp 2), without dropout and biases (the key
    bias's gradient is exactly 0, which Adam turns into noise-sized steps no parity test can pin down)."""
    import helpers

    return helpers.tiny(
        "bert",
        vocab_size=1001,
        hidden_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias=False,
    )


def padded_batch(step, gas, dp_rank):
    """test_engine's micro-batch with a padding mask: sequence 0's last 5 tokens are padding (labels ignored)."""
    from test_engine import micro_batch

    batch = micro_batch(step, gas, dp_rank)
    mask, labels = torch.ones_like(batch["input_ids"]), batch["labels"].clone()
    mask[0, -5:], labels[0, -5:] = 0, -100
    return {**batch, "labels": labels, "attention_mask": mask}


def engine_cp_body(tp, cp, method, stages, mlp_tiles=0, arch="llama"):
    import plait
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh
    from plait.parallel.sharding import gather_logical_state
    from test_engine import GAS, STEPS, ds_config, micro_batch, tiny

    arch_config, batch = (
        (tiny(mlp_chunk_tokens=mlp_tiles), micro_batch)
        if arch == "llama"
        else (bert_tiny(), padded_batch)
    )
    results = {}
    for stage in stages:
        mesh = ParallelMesh(tp=tp, cp=cp)
        model = TransformerModel(arch_config, mesh, seed=5, cp_method=method)
        cfg = {**ds_config(stage, tp), "context_parallel": {"size": cp, "method": method}}
        engine = plait.initialize(model, cfg, mesh=mesh)
        losses = []
        for step in range(STEPS):  # whole sequences; the engine keeps this cp rank's chunks
            losses.append(
                engine.train_batch(iter([batch(step, g, mesh.dp_rank) for g in range(GAS)])).item()
            )
        with engine.optimizer.gathered_parameters():
            whole = {
                n: t.float().cpu() for n, t in gather_logical_state(model, mesh.tp_group).items()
            }
        results[stage] = (whole, losses, engine.global_steps, engine.get_lr()[0])
    return results if dist.get_rank() == 0 else None


@pytest.mark.parametrize(
    "tp, cp, method, stages, mlp_tiles",
    [
        (1, 2, "ring", (0, 1, 2, 3), 0),
        (2, 2, "ring", (1, 3), 0),
        (1, 2, "all_to_all", (3,), 0),
        (1, 4, "ring", (3,), 0),
        (1, 2, "ring", (3,), 3),
    ],
)
def test_engine_with_context_parallel_matches_single_process_adamw(
    tp, cp, method, stages, mlp_tiles
):
    """5 AdamW steps (GAS 2, clipping, warm-up) through ``plait.initialize`` with ``context_parallel``: the loss
    curve and every weight equal one process on whole sequences (test_engine's contract, 1e-6 on weights and
    1e-5 on losses), with tensor parallelism, over ZeRO stages 0-3, and with the MLP in tiles of 3 positions
    (``mlp_chunk_tokens``; the reference runs it whole)."""
    from test_engine import check_engine_results, reference

    ref_weights, ref_losses = reference(1)
    results = run_distributed(engine_cp_body, tp * cp, tp, cp, method, stages, mlp_tiles)[0]
    check_engine_results(results, ref_weights, ref_losses, tp, 1)


@pytest.mark.parametrize(
    "arch, schedule, method, stages",
    [("llama-tied", "1f1b", "ring", (1, 3)), ("llama", "zb-h1", "all_to_all", (1,))],
)
def test_engine_with_pipeline_and_context_parallel_matches_single_process(
    arch, schedule, method, stages
):
    """pp=2 x cp=2: the pipeline's micro-batches cut into each cp rank's chunks (activations travel between
    stages at s/cp), the tied embedding/head summed per (dp, cp) column, ZeRO over dp x cp: test_engine's
    contract against one process on whole sequences (1e-6 on weights, 1e-5 on losses)."""
    from test_engine import check_pipeline_results, pipeline_body, reference, tiny_arch

    ref_weights, ref_losses = reference(1, tiny_arch(arch))
    per_rank = run_distributed(pipeline_body, 4, arch, schedule, 2, method, stages)[0]
    check_pipeline_results(
        per_rank, stages, ref_weights, ref_losses, f"pp=2 cp=2 {method} {schedule} {arch}"
    )


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_engine_trains_padded_bert_with_tp_and_context_parallel_as_one_process(method):
    """BERT (bidirectional) with padding masks, tp 2 x cp 2, ZeRO-1 and ZeRO-3: test_engine's contract against
    one process on whole sequences (1e-6 on weights, 1e-5 on losses)."""
    from test_engine import check_engine_results, reference

    ref_weights, ref_losses = reference(1, bert_tiny(), padded_batch)
    results = run_distributed(engine_cp_body, 4, 2, 2, method, (1, 3), 0, "bert")[0]
    check_engine_results(results, ref_weights, ref_losses, 2, 1)


def test_engine_refuses_a_context_parallel_config_the_model_was_not_built_for():
    import plait
    from plait.config import ConfigError
    from plait.layers import TransformerModel
    from test_engine import ds_config, tiny

    with pytest.raises(ConfigError, match=r"context_parallel.size=2 but the mesh has cp=1"):
        plait.initialize(
            TransformerModel(tiny(), None),
            {**ds_config(1, 1), "context_parallel": {"size": 2}},
            mesh=__import__("plait.parallel", fromlist=["ParallelMesh"]).ParallelMesh(),
        )


def all_to_all_heads_body():
    from plait.layers.attention import Attention

    group = dist.new_group([0, 1])
    with pytest.raises(ValueError) as err:
        Attention(64, 4, 1, cp_group=group, cp_method="all_to_all")
    return str(err.value)


def test_all_to_all_needs_heads_divisible_by_tp_times_cp():
    msg = run_distributed(all_to_all_heads_body, 2)[0]
    assert "num_kv_heads (1) divisible by tp x cp = 1 x 2" in msg and "cp_method='ring'" in msg


def lamb_cp_body():
    """LAMB (per-tensor trust ratio from norms summed over the ZeRO shards) with ZeRO-2 over dp 1 x cp 2."""
    import plait
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh
    from plait.parallel.sharding import gather_logical_state
    from test_engine import GAS, ds_config, micro_batch, tiny

    mesh = ParallelMesh(cp=2)
    model = TransformerModel(tiny(), mesh, seed=5)
    cfg = {k: v for k, v in ds_config(2, 1).items() if k != "scheduler"}
    cfg.update(
        optimizer={"type": "LAMB", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        gradient_clipping=0.0,
        context_parallel={"size": 2},
    )
    engine = plait.initialize(model, cfg, mesh=mesh)
    for step in range(3):
        engine.train_batch(iter([micro_batch(step, g, mesh.dp_rank) for g in range(GAS)]))
    with engine.optimizer.gathered_parameters():
        return {n: t.float() for n, t in gather_logical_state(model, mesh.tp_group).items()}


def test_lamb_under_context_parallel_matches_per_tensor_lamb():
    """LAMB's norms are summed over ZeRO's dp x cp ranks (over dp alone each cp rank would take its trust
    ratio from half of every norm, and the cp ranks' shards would drift apart)."""
    from plait.layers import TransformerModel
    from plait.optim.lamb import Lamb
    from plait.parallel.sharding import gather_logical_state
    from plait.zero import weight_decay_groups
    from test_engine import GAS, micro_batch, tiny

    model = TransformerModel(tiny(), None, seed=5)
    opt = Lamb(weight_decay_groups(model, 0.01), lr=1e-2, eps=1e-8)
    for step in range(3):
        for g in range(GAS):
            (model(**micro_batch(step, g, 0)) / GAS).backward()
        opt.step()
        opt.zero_grad()
    ref = gather_logical_state(model)
    for rank_weights in run_distributed(lamb_cp_body, 2):
        for name, w in ref.items():
            assert rel_err(rank_weights[name], w) <= 1e-6, name


def test_context_parallel_guards():
    """Learned positions: the whole sequence must fit max_position_embeddings; positional tensors are refused."""
    results = run_distributed(guards_body, 2)
    assert (
        "sequence length 512 (256 on each of cp=2 ranks) exceeds max_position_embeddings (256)"
        in results[0][0]
    )
    assert "pass the batch by keyword" in results[0][1]


def guards_body():
    from plait.engine.context import shard_batch
    from plait.layers import TransformerModel
    from plait.parallel import ParallelMesh

    mesh = ParallelMesh(cp=2)
    model = TransformerModel(model_config("gpt2"), mesh, seed=3)
    with pytest.raises(ValueError) as long_seq:
        model(input_ids=torch.zeros(1, 256, dtype=torch.long))
    with pytest.raises(ValueError) as positional:
        shard_batch({}, mesh, (torch.zeros(1, 8),))
    return str(long_seq.value), str(positional.value)


def test_a_pipeline_rank_without_attention_passes_the_context_parallel_check():
    """A pipeline stage may hold only the embedding or only the head: nothing to check there; without a
    pipeline the same model is refused, naming the fix."""
    from types import SimpleNamespace

    from plait.config import ConfigError, load_config
    from plait.engine.context import check_context_parallel

    config = load_config(
        {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}, dp_size=1
    )
    embedding_only = torch.nn.ModuleList([torch.nn.Embedding(8, 4)])
    check_context_parallel(config, SimpleNamespace(cp=2), embedding_only, pipeline=object())
    with pytest.raises(ConfigError, match="no attention layer of the model splits the sequence"):
        check_context_parallel(config, SimpleNamespace(cp=2), embedding_only, pipeline=None)
