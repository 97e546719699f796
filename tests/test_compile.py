"""Regional compilation (ds_config ``compile``, ``engine.compile``; ``plait.engine.compile``).

Parity: a compiled engine against the same engine in eager mode, 4 steps of a tiny Llama, float32, whole
weights to 1e-6 norm-relative (``||w_c - w_e|| / ||w_e||``). Why 1e-6: inductor reorders and fuses the
fp32 reductions (RMSNorm, softmax, the loss), so gradients differ from eager at a few ulps (~1e-7
relative), and SGD with momentum moves the weights by lr times those gradients: differences of the same
relative order. (Adam is not used here: its update g / sqrt(v) turns the rounding of a near-zero
gradient into a step of about lr, so its weights differ by whatever the CPU's vector width makes of
those ulps.) A 1% larger learning rate moves the weights far more: the test shows that variant failing
the bound. The tensor-parallel checks use aot_eager (the same ATen kernels) and AdamW.
"""

import logging
import os

import pytest
import torch
import torch.distributed as dist

import plait
from plait.config import ConfigError, load_config
from plait.engine.compile import compile_regions, compile_targets, is_compiled
from plait.layers import TransformerModel
from plait.layers.block import TransformerBlock
from plait.layers.model import LMHead
from plait.parallel import ParallelMesh
from plait.parallel.sharding import gather_full, shard_of
from plait.testing import run_distributed
import helpers

STEPS, MICRO, SEQ, VOCAB = 4, 2, 16, 1001


def tiny(**overrides):
    return helpers.tiny(vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=96, **overrides)


ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
SGD = {"type": "SGD", "params": {"lr": 0.3, "momentum": 0.9}}


def ds_config(stage, compile_section=None, lr=None, tp=1, sp=False, optimizer=ADAMW):
    optimizer = {
        "type": optimizer["type"],
        "params": {**optimizer["params"], **({"lr": lr} if lr else {})},
    }
    raw = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "optimizer": optimizer,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
        "tensor_parallel": {"size": tp, "sequence_parallel": sp},
    }
    if compile_section is not None:
        raw["compile"] = compile_section
    return raw


def train(stage, compile_section=None, lr=None, tp=1, sp=False, optimizer=ADAMW, **model_overrides):
    """Whole float32 weights after STEPS steps, and the engine."""
    mesh = ParallelMesh(tp=tp)
    model = TransformerModel(
        tiny(**model_overrides), mesh if tp > 1 else None, seed=5, sequence_parallel=sp
    )
    engine = plait.initialize(
        model, ds_config(stage, compile_section, lr, tp, sp, optimizer), mesh=mesh
    )
    for step in range(STEPS):
        loss = engine(**helpers.micro_batch(step, 0, 0, vocab_size=VOCAB, micro=MICRO, seq=SEQ))
        engine.backward(loss)
        engine.step()
    with engine.gathered_parameters():
        whole = [
            gather_full(p.detach(), shard_of(p), mesh.tp_group).float().flatten()
            for p in model.parameters()
        ]
    return torch.cat(whole), engine


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _single_process(fn, *args):
    return run_distributed(fn, 1, *args, timeout_s=600)[0]


def _compiled_parity(backend):
    out = {}
    for stage in (0, 3):
        eager, _ = train(stage, optimizer=SGD)
        compiled, engine = train(stage, {"enabled": True, "backend": backend}, optimizer=SGD)
        out[stage] = (rel(compiled, eager), engine.is_compiled)
    out["lr+1%"] = rel(train(3, lr=0.303, optimizer=SGD)[0], eager)
    return out


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            "inductor",
            marks=pytest.mark.xfail(
                os.environ.get("ATEN_CPU_CAPABILITY") == "avx2",
                strict=False,
                reason="torch 2.13's inductor CPU code gives non-finite attention weight gradients for this block under "
                "ATEN_CPU_CAPABILITY=avx2 (eager is finite; the nonfinite guard then skips those steps)",
            ),
        ),
        "aot_eager",
    ],
)
def test_compiled_engine_matches_eager_at_zero_stages_0_and_3(backend):
    result = _single_process(_compiled_parity, backend)
    for stage in (0, 3):
        err, compiled = result[stage]
        assert compiled and err < 1e-6, (stage, err)
    assert result["lr+1%"] > 1e-6  # the bound tells a 1% learning-rate change apart


def _tp_parity(sp, fused_loss):
    eager, _ = train(1, tp=2, sp=sp, fused_loss_chunk_tokens=fused_loss)
    compiled, engine = train(
        1,
        {"enabled": True, "backend": "aot_eager"},
        tp=2,
        sp=sp,
        fused_loss_chunk_tokens=fused_loss,
    )
    return rel(compiled, eager), engine.is_compiled


@pytest.mark.parametrize("sp, fused_loss", [(False, 0), (True, 7)])
def test_compiled_tensor_parallel_engine_matches_eager(sp, fused_loss):
    """tp=2 (gloo): the blocks' and the head's tensor-parallel collectives are traced into the graph (AOT
    autograd, forward and backward; the fused loss's token chunks unrolled) and give the eager weights."""
    for err, compiled in run_distributed(_tp_parity, 2, sp, fused_loss, timeout_s=600):
        assert compiled and err < 1e-6, err


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_a_block_traces_as_one_graph(recompute):
    block = TransformerBlock(tiny(), recompute=recompute)
    block.train()
    x = torch.randn(MICRO, SEQ, 64, requires_grad=True)
    explained = torch._dynamo.explain(block.forward)(x, {})
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


def _tp_breaks(sp, fused_loss):
    model = TransformerModel(
        tiny(fused_loss_chunk_tokens=fused_loss), ParallelMesh(tp=2), seed=5, sequence_parallel=sp
    )
    block, *_, head = compile_targets(model)
    x = torch.randn(MICRO, SEQ // (2 if sp else 1), 64, requires_grad=True)
    labels = helpers.micro_batch(0, 0, 0, vocab_size=VOCAB, micro=MICRO, seq=SEQ)["labels"]
    breaks = [
        torch._dynamo.explain(block.forward)(x, {}).graph_break_count,
        torch._dynamo.explain(head.forward)(x, {"labels": labels}).graph_break_count,
    ]
    return breaks, dist.get_world_size()


@pytest.mark.parametrize("sp, fused_loss", [(False, 0), (True, 0), (True, 5)])
def test_a_tensor_parallel_block_and_head_trace_as_one_graph_each(sp, fused_loss):
    assert run_distributed(_tp_breaks, 2, sp, fused_loss) == [([0, 0], 2), ([0, 0], 2)]


def test_regions_are_the_blocks_and_names_do_not_change():
    model = TransformerModel(tiny(), None, seed=5)
    names = [n for n, _ in model.named_parameters()]
    done = compile_regions(model, backend="eager")
    assert (
        done == [m for m in model.modules() if isinstance(m, (TransformerBlock, LMHead))]
        and len(done) == 3
    )
    assert compile_regions(model, backend="eager") == [] and is_compiled(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert not any("_orig_mod" in key for key in model.state_dict())


def test_hugging_face_regions_are_its_decoder_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    assert [type(m).__name__ for m in compile_targets(hf)] == ["LlamaDecoderLayer"] * 2
    assert compile_targets(torch.nn.Linear(2, 2))[0].__class__ is torch.nn.Linear


@pytest.mark.parametrize(
    "section, on",
    [
        ({"enabled": True}, True),
        ({"enabled": False}, False),
        ({"disable": False, "backend": "inductor"}, True),
        ({"disable": True}, False),
        ({"deepcompile": True, "free_activation": True}, True),
        ({"deepcompile": False}, False),
        ({}, False),
    ],
)
def test_the_compile_section_reads_deepspeeds_spellings(section, on, caplog):
    cfg = load_config({"train_batch_size": 8, "compile": section}, dp_size=1)
    assert cfg.compile.on is on
    assert caplog.text == ""


@pytest.mark.parametrize(
    "section, match",
    [
        ({"enabled": True, "disable": True}, "contradict"),
        ({"kwargs": {"backend": "eager"}}, "compile.backend"),
        ({"kwargs": "fast"}, "compile.kwargs"),
        ({"enabled": "yes"}, "compile.enabled"),
    ],
)
def test_bad_compile_sections_are_refused(section, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"train_batch_size": 8, "compile": section}, dp_size=1)


def test_engine_compile_is_deepspeeds_api(caplog):
    model = TransformerModel(tiny(), None, seed=5)
    engine = plait.initialize(model, ds_config(2, {"deepcompile": True}), mesh=ParallelMesh())
    assert engine.is_compiled and "instead of DeepCompile" in caplog.text
    engine.compile(backend="eager")  # a second call: no-op
    with pytest.raises(ValueError, match="compiled autograd"):
        engine.compile(compiled_autograd_enabled=True)
    with caplog.at_level(logging.INFO):
        plain = plait.initialize(
            TransformerModel(tiny(), None, seed=5), ds_config(2), mesh=ParallelMesh()
        )
        assert not plain.is_compiled
        plain.compile(backend="eager", compile_kwargs={"dynamic": False})
    assert plain.is_compiled


def test_rope_tables_are_computed_once_per_forward(monkeypatch):
    """The model computes RoPE's cos/sin once for all its blocks (inside a compiled block they would be
    recomputed in every rotary kernel, forward and backward); the result equals per-block tables."""
    import plait.layers.attention as attention
    import plait.layers.model as model_module

    calls = []
    for module in (attention, model_module):
        monkeypatch.setattr(
            module, "rope_cos_sin", lambda *a, _f=module.rope_cos_sin: calls.append(1) or _f(*a)
        )
    model = TransformerModel(tiny(), None, seed=5)
    batch = helpers.micro_batch(0, 0, 0, vocab_size=VOCAB, micro=MICRO, seq=SEQ)
    once = model(**batch)
    assert len(calls) == 1
    monkeypatch.setattr(TransformerModel, "_rope_tables", lambda self, batch, hidden: None)
    per_block = model(**batch)
    assert len(calls) == 1 + tiny().num_layers and torch.equal(once, per_block)


def test_a_deep_copy_of_a_compiled_model_computes_with_its_own_weights():
    """The compiled forward is a method bound to its block: ``copy.deepcopy`` (EMA or reference copies)
    rebinds it to the copy, which then computes with the copy's weights."""
    import copy

    model = TransformerModel(tiny(), None, seed=5)
    compile_regions(model, backend="eager")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randn(MICRO, SEQ, 64)
    block, twin_block = model.layers["1"], twin.layers["1"]
    assert twin_block.forward.__self__ is twin_block and is_compiled(twin)
    assert torch.equal(twin_block(x, {}), x)  # zero weights: the residual stream passes unchanged
    assert not torch.equal(block(x, {}), x)


def _zero_bubble_refused():
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel

    mesh = ParallelMesh(tp=1, pp=2)
    pipe = PipelineParallel(
        build_stage_modules(tiny(), mesh, seed=5), mesh, schedule="zb-h1", micro_batches=2
    )
    cfg = ds_config(1, {"enabled": True, "backend": "eager"})
    cfg.update(gradient_accumulation_steps=2, pipeline={"size": 2, "schedule": "zb-h1"})
    try:
        plait.initialize(pipe, cfg, mesh=mesh)
    except ConfigError as err:
        return str(err)
    return None


def test_compile_with_a_zero_bubble_schedule_is_refused():
    """The zero-bubble split cannot split a compiled block (one autograd node): it would run its whole
    backward in both passes. Refused naming the schedule and the fix."""
    for message in run_distributed(_zero_bubble_refused, 2):
        assert message is not None and "'zb-h1'" in message and "use schedule '1f1b'" in message


def test_compiling_again_with_another_backend_says_so(caplog):
    engine = plait.initialize(
        TransformerModel(tiny(), None, seed=5),
        ds_config(2, {"enabled": True, "backend": "eager"}),
        mesh=ParallelMesh(),
    )
    engine.compile(backend="aot_eager")
    assert "compiled with backend 'eager' already" in caplog.text
