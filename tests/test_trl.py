"""``plait.trl``: TRL's SFT and DPO scripts (``tests/data/trl_script.py``, written as TRL's docs show, only the import
line naming plait) against the same script with ``from trl import`` and no DeepSpeed, on CPU, with FastChat's
ZeRO-2 (optimizer offload) and ZeRO-3 (optimizer and parameter offload) configs, at 1 and 2 processes.

Tolerance 1e-6 on each of 10 logged step losses (float32; the runs take the same batches and the same AdamW and
schedule and differ in summation order only: measured <= 1.2e-7). The comparison runs with ``max_grad_norm=0``:
with clipping on, plain TRL's coefficient comes from torch's float32 ``clip_grad_norm_``, whose step-1 norm here is
2.977663 while the float64 norm of the same gradients is 2.9777828 (plait's: 2.9777828); Adam's eps term turns
that 4e-5 into loss differences of 1e-5 from step 2 on.
The resume (dropout on) is exact: bitwise, as in tests/test_hf_resume_dropout.py. At the lowest pins (transformers
4.56, trl 0.18.2) the runs agree too (0 difference: plait's loop counts the step's label tokens as the installed
transformers does, and both sides log losses rounded alike).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

DATA = Path(__file__).parent / "data"
SCRIPT = DATA / "trl_script.py"
ZERO2 = DATA / "ds_configs" / "fastchat__deepspeed_config_s2.json"
ZERO3 = DATA / "ds_configs" / "fastchat__deepspeed_config_s3.json"


def launch(out: Path, script: Path, task: str, config, steps: int, *extra, procs: int = 1):
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
           str(script), task, str(out), str(config), str(steps), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in map(json.loads, (out / "losses.jsonl").read_text().splitlines())}
    results = [json.loads((out / f"result-{r}.json").read_text()) for r in range(procs)]
    return losses, results


CASES = {"sft-1proc-zero2": ("sft", ZERO2, 1), "dpo-2proc-zero3": ("dpo", ZERO3, 2)}
NOCLIP = ("--max-grad-norm", "0")


@pytest.fixture(scope="module")
def plait_runs(tmp_path_factory):
    """One launch per case on plait (clipping off, see the module docstring)."""
    tmp = tmp_path_factory.mktemp("trl_plait")
    return {case: launch(tmp / case, SCRIPT, task, config, 10, *NOCLIP, procs=procs)
            for case, (task, config, procs) in CASES.items()}


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """The same script with ``from trl import`` and no ds_config, one launch per case."""
    tmp = tmp_path_factory.mktemp("trl_plain")
    plain = tmp / "plain_script.py"
    text = SCRIPT.read_text()
    assert "from plait.trl import" in text
    plain.write_text(text.replace("from plait.trl import", "from trl import"))
    return {case: launch(tmp / case, plain, task, "none", 10, *NOCLIP, procs=procs)
            for case, (task, _, procs) in CASES.items()}


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """An SFT run with dropout at 2 processes under ZeRO-3, whole and resumed from its step-5 checkpoint."""
    tmp = tmp_path_factory.mktemp("trl_resume")
    full = launch(tmp / "full", SCRIPT, "sft", ZERO3, 10, "--dropout", "0.1", procs=2)
    return full, launch(tmp / "resumed", SCRIPT, "sft", ZERO3, 10, "--dropout", "0.1",
                        "--resume", str(tmp / "full" / "checkpoint-5"), procs=2)


@pytest.mark.parametrize("case", list(CASES))
def test_the_script_on_plait_gives_plain_trls_losses(case, plait_runs, plain_runs):
    assert sorted(plait_runs[case][0]) == list(range(1, 11))
    worst = max(abs(plait_runs[case][0][s] - plain_runs[case][0][s]) for s in range(1, 11))
    assert worst <= 1e-6, (plait_runs[case][0], plain_runs[case][0])
    assert plain_runs[case][1][0]["ref_params_bytes"] is None     # plain TRL: a whole reference copy, no engine


@pytest.mark.parametrize("case", list(CASES))
def test_the_script_trains_on_plait(case, plait_runs):
    losses = plait_runs[case][0]
    assert sorted(losses) == list(range(1, 11)) and abs(losses[10] - losses[1]) > 1e-2


def test_dpo_reference_model_is_sharded_under_zero3(plait_runs):
    """The reference model's forward-only engine (TRL's prepare_deepspeed): under ZeRO-3 each of the 2 ranks holds
    about half (the embedding and the head, 1.05M elements each, are sharded; the block weights stay whole under
    the config's 1e6-element persistence threshold)."""
    for rank in plait_runs["dpo-2proc-zero3"][1]:
        assert 0.45 * rank["whole_bytes"] < rank["ref_params_bytes"] < 0.55 * rank["whole_bytes"]


def test_a_resumed_sft_run_with_dropout_repeats_the_uninterrupted_steps(resume_runs):
    (full, _), (resumed, _) = resume_runs
    assert sorted(resumed) == list(range(6, 11))           # the steps after the checkpoint
    assert {s: resumed[s] for s in range(6, 11)} == {s: full[s] for s in range(6, 11)}
    assert len(set(full.values())) == 10


def test_dpo_reference_under_zero2_is_a_forward_only_stage_0_engine(tmp_path):
    """ZeRO stages 0-2: the reference model is whole on each rank (stage 0) and has no optimizer, as TRL's
    prepare_deepspeed makes it; the config's optimizer offload is not carried over."""
    from datasets import Dataset

    from plait.engine import Engine
    from plait.trl import DPOConfig, DPOTrainer
    model, tokenizer = _tiny()
    ref, _ = _tiny()
    args = DPOConfig(output_dir=str(tmp_path), deepspeed=str(ZERO2), use_cpu=True, report_to=[], max_steps=1,
                     per_device_train_batch_size=2, bf16=False, save_strategy="no")
    data = Dataset.from_dict({"prompt": ["a"] * 4, "chosen": ["a a"] * 4, "rejected": ["a"] * 4})
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    assert isinstance(trainer.ref_model, Engine) and trainer.ref_model.forward_only
    assert trainer.ref_model.zero_optimization_stage() == 0 and trainer.engine.zero_optimization_stage() == 2
    assert not trainer.ref_model.module.training


def _tiny():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                        padding_side="left")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    return model, tokenizer


def test_a_feature_plait_does_not_serve_is_refused_by_name(tmp_path):
    from datasets import Dataset

    from plait.config import ConfigError
    from plait.trl import SFTConfig, SFTTrainer
    model, tokenizer = _tiny()
    args = SFTConfig(output_dir=str(tmp_path), deepspeed={"zero_optimization": {"stage": 2}}, use_cpu=True,
                     report_to=[], activation_offloading=True)
    with pytest.raises(ConfigError, match=r"activation_offloading=True: .*set activation_offloading=False in the SFTConfig"):
        SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": ["a a a"] * 4}),
                   processing_class=tokenizer)


def test_grpo_is_refused_naming_what_plait_does_not_serve(tmp_path):
    from datasets import Dataset

    from plait.config import ConfigError
    from plait.trl import GRPOConfig, GRPOTrainer
    model, tokenizer = _tiny()
    args = GRPOConfig(output_dir=str(tmp_path), deepspeed={"zero_optimization": {"stage": 3}}, use_cpu=True,
                      report_to=[], per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(ConfigError, match=r"GRPOTrainer: .*own sampler .*unwrap_model.*trl.GRPOTrainer"):
        GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                    train_dataset=Dataset.from_dict({"prompt": ["a a"] * 4}), processing_class=tokenizer)


def test_reward_trainer_on_plait_gives_plain_trls_losses(tmp_path):
    """TRL's RewardTrainer (a sequence-classification model, chosen/rejected pairs) on plait's ZeRO-2 and plain, in
    this process: the same logged losses, to 1e-6 (transformers >= 5) or to the 4 decimals transformers 4.x rounds
    the plain run's logged loss to (5e-5 and float32 rounding)."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from trl import RewardConfig as PlainConfig, RewardTrainer as PlainTrainer

    from plait.trl import RewardConfig, RewardTrainer
    _, tokenizer = _tiny()
    data = Dataset.from_dict({"chosen": ["a a a", "a a"] * 4, "rejected": ["a", "<unk> a"] * 4})

    def losses(trainer_class, config_class, **ds):
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                           num_hidden_layers=1, num_attention_heads=2,
                                                           num_key_value_heads=2, num_labels=1, pad_token_id=0))
        args = config_class(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=6, seed=3,
                            per_device_train_batch_size=4, learning_rate=1e-2, bf16=False, logging_steps=1,
                            save_strategy="no", max_grad_norm=0.0, **ds)
        trainer = trainer_class(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    got = losses(RewardTrainer, RewardConfig, deepspeed={"zero_optimization": {"stage": 2}})
    want = losses(PlainTrainer, PlainConfig)
    tol = 1e-6 if Version(transformers.__version__) >= Version("5") else 5e-5 + 1e-6
    assert len(got) == len(want) == 6 and max(abs(a - b) for a, b in zip(got, want)) <= tol, (got, want)
    assert got[0] - got[-1] > 0.1                       # the pairs get separated
