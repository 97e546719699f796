"""The way back to Hugging Face after training a transformers model as it is (``examples/finetune_hf.py``,
``plait.hf.Trainer``): the checkpoint records the model's class and config, ``plait convert to-hf`` writes its
own parameter names plus config.json, ``--hf-config`` serves checkpoints saved without them, and
``--tokenizer-from`` keeps every tokenizer file (chat templates included)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

import plait.deepspeed as deepspeed
from plait.checkpoint import CheckpointWriter, convert
from plait.checkpoint.writer import ShardItem
from plait.cli import main


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=96,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A GPT-2 trained two ZeRO-3 steps by the engine and saved; (root, the trained weights)."""
    import torch.distributed as dist

    root = tmp_path_factory.mktemp("ft") / "checkpoints"
    engine, *_ = deepspeed.initialize(
        model=gpt2(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3},
        },
    )
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(root))
    with engine.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    dist.destroy_process_group()
    return root, weights


def test_to_hf_after_finetuning_a_transformers_model_loads_the_trained_weights(
    trained, tmp_path, capsys
):
    root, weights = trained
    assert main(["convert", "to-hf", str(root), str(tmp_path / "hf")]) == 0
    assert "wrote GPT2LMHeadModel to" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "GPT2LMHeadModel"
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name  # bit for bit
    assert torch.equal(model.lm_head.weight, weights["transformer.wte.weight"])  # tied head


def test_hf_config_flag_exports_a_checkpoint_saved_without_one(tmp_path, capsys):
    """A checkpoint of a transformers model's own names with no config in meta.json (as older plait saved)."""
    model = gpt2()
    writer = CheckpointWriter(str(tmp_path / "old"))
    writer.save("step1", [ShardItem.whole(n, p.detach()) for n, p in model.named_parameters()], {})
    assert main(["convert", "to-hf", str(tmp_path / "old"), str(tmp_path / "a")]) == 2
    assert (
        "pass the model's original config.json (plait convert to-hf --hf-config PATH"
        in capsys.readouterr().err
    )
    model.config.to_json_file(tmp_path / "config.json")
    assert (
        main(
            [
                "convert",
                "to-hf",
                str(tmp_path / "old"),
                str(tmp_path / "b"),
                "--hf-config",
                str(tmp_path / "config.json"),
            ]
        )
        == 0
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    assert all(
        torch.equal(p, dict(model.named_parameters())[n]) for n, p in back.named_parameters()
    )
    llama = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
    )
    llama.architectures = ["LlamaForCausalLM"]
    llama.to_json_file(tmp_path / "llama.json")
    assert (
        main(
            [
                "convert",
                "to-hf",
                str(tmp_path / "old"),
                str(tmp_path / "c"),
                "--hf-config",
                str(tmp_path / "llama.json"),
            ]
        )
        == 2
    )
    assert "checkpoint tensors are not parameters of LlamaForCausalLM" in capsys.readouterr().err


def test_tokenizer_from_keeps_every_tokenizer_file(trained, tmp_path):
    src = tmp_path / "base"
    (src / "additional_chat_templates").mkdir(parents=True)
    files = {
        "tokenizer.json": "{}",
        "tokenizer_config.json": "{}",
        "special_tokens_map.json": "{}",
        "chat_template.jinja": "{{ messages }}",
        "additional_chat_templates/tool_use.jinja": "{{ tools }}",
        "generation_config.json": "{}",
        "config.json": "{}",
        "model.safetensors": "weights",
        "README.md": "x",
    }
    for name, text in files.items():
        (src / name).write_text(text)
    report = convert.to_hf(str(trained[0]), str(tmp_path / "out"), tokenizer_from=str(src))
    copied = [
        "additional_chat_templates/tool_use.jinja",
        "chat_template.jinja",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert report.files == ["model.safetensors", *copied]
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gpt2"
    )  # not the base's
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        {"config.json", "model.safetensors", *(c.split("/")[0] for c in copied)}
    )
