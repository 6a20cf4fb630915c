"""Hugging Face: a transformers Trainer that trains with any unison algorithm.

torchrun --nproc-per-node 2 examples/huggingface_trainer.py --algorithm diloco:period=8

A GPT-2 built from a small config (nothing downloaded) learns characters of the Python standard
library's source (unison.apps.workloads.charlm: text already on disk). The only change from a
plain Trainer script is UnisonTrainer and its algorithm argument. Needs the hf extra:
pip install -e ".[hf]". On GPUs, torchrun or accelerate launch --multi_gpu. See docs/huggingface.md.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from unison.apps.workloads import charlm
from unison.integrations.huggingface import UnisonTrainer


class Characters(torch.utils.data.Dataset):
    """Windows of characters as the Trainer feeds a causal LM: input_ids and labels alike."""

    def __init__(self, ids, context):
        self.windows = charlm.CharDataset(ids, context)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        x, y = self.windows[i]
        window = torch.cat([x, y[-1:]])
        return {"input_ids": window, "labels": window}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithm", default="diloco:period=8")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="hf-trainer-out")
    args = parser.parse_args()
    text = charlm.load_text(max_bytes=1 << 18)
    vocab = charlm.Vocab(text)
    train, val = charlm.split(vocab.encode(text))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=64, n_layer=2, n_head=4)
    trainer = UnisonTrainer(
        model=GPT2LMHeadModel(config),
        args=TrainingArguments(
            output_dir=args.out,
            per_device_train_batch_size=16,
            max_steps=args.steps,
            learning_rate=3e-3,
            logging_steps=20,
            eval_strategy="steps",
            eval_steps=args.steps,
            per_device_eval_batch_size=64,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        ),
        train_dataset=Characters(train, context=63),
        eval_dataset=torch.utils.data.Subset(Characters(val, context=63), range(256)),
        algorithm=args.algorithm,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']} loss {entry['loss']:.3f} unison sent {entry['unison_bytes_sent']} bytes")
            if "eval_loss" in entry:
                print(f"step {entry['step']} eval loss {entry['eval_loss']:.3f}")
