"""``plait.hf.Trainer`` resumes bit for bit with dropout on, as transformers' own Trainer does.

A resumed run restores the ranks' RNG states from the checkpoint; the dropout masks of the steps after it
must be those of the uninterrupted run. They are only if the states are restored after everything that
draws from the generators before the first trained micro-batch (the DataLoader iterator draws its base
seed when made, and a data collator such as MLM masking draws per micro-batch: micro-batches already trained
are skipped without being collated). Tolerance: 0 (same kernels, same order: the runs are bitwise equal);
restoring the RNG before the iterator is made, or collating the skipped micro-batches, moves every mask and
the losses differ from the third decimal on.
"""

import torch
import transformers

from plait.hf import Trainer, TrainingArguments

CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "zero_optimization": {"stage": 2},
}


def tiny_bert():
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            hidden_dropout_prob=0.3,
            attention_probs_dropout_prob=0.3,
        )
    )


class Masking:
    """MLM masking as ``DataCollatorForLanguageModeling`` does it: draws from torch's global generator."""

    def __call__(self, rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        labels = ids.clone()
        masked = torch.rand(ids.shape) < 0.3
        labels[~masked] = -100
        return {"input_ids": ids.masked_fill(masked, 3), "labels": labels}


def run(out, resume=None, max_steps=6):
    data = [{"input_ids": [(7 * i + j) % 64 for j in range(8)]} for i in range(48)]
    args = TrainingArguments(
        output_dir=str(out),
        deepspeed=CONFIG,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_steps=max_steps,
        report_to=[],
        use_cpu=True,
        save_steps=3,
        logging_steps=1,
        seed=11,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=data, data_collator=Masking())
    trainer.train(resume_from_checkpoint=resume)
    return {
        h["step"]: (h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h
    }


def test_a_resumed_run_with_dropout_repeats_the_uninterrupted_steps_bitwise(tmp_path):
    full = run(tmp_path / "full")
    logged = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    assert {s: logged[s] for s in (1, 2, 3)} == {
        s: full[s] for s in (1, 2, 3)
    }  # the checkpoint's history
    resumed = {s: logged[s] for s in logged if s > 3}
    assert sorted(resumed) == [4, 5, 6]
    assert {s: full[s] for s in (4, 5, 6)} == resumed
    assert len({full[s][0] for s in full}) == len(
        full
    )  # every step's loss differs: a shift would show
