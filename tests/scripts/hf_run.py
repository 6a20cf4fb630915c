"""Hugging Face runs for tests/integration/test_huggingface.py, under torchrun
(2 processes, gloo on CPU): a GPT-2 built from a small config (no download) learns sequences that
step by a fixed stride. Each run trains its contenders and writes OUT/<name>-rank<R>.pt
(per rank: the final weights flattened, the logged losses, the logs' unison_bytes_sent).

Runs, in the order given (one launch, several runs):
  trainer-ddp        the Trainer's own DDP, UnisonTrainer with allreduce, then UnisonTrainer with
                     allreduce resumed from the first's checkpoint-10 (20 steps, accumulation 2);
                     then the first two again in bf16 (OUT/ddp-bf16-*, OUT/allreduce-bf16-*)
  trainer=ALGORITHM  UnisonTrainer with ALGORITHM for 20 steps (a checkpoint and an evaluation at
                     10), then resumed from that checkpoint (OUT/NAME-rank*.pt, OUT/NAME-resumed-rank*.pt)
  accelerate=ALGORITHM  a loop on UnisonAccelerator.prepare (save_state at step 5, then on), the
                     same loop on unison.DataParallel directly, and the first resumed by load_state
  refusals           what is refused at construction: OUT/refusals.json (rank 0)
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import unison
from unison.integrations.huggingface import UnisonAccelerator, UnisonTrainer

VOCAB, LENGTH, SEQUENCES = 64, 16, 512
STEPS, ACCUMULATE, BATCH = 20, 2, 4


class Strides(Dataset):
    """Sequence i starts at a token and steps by a stride of 1, 2 or 3 (mod VOCAB): learnable."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, VOCAB, (SEQUENCES, 1), generator=g)
        strides = torch.randint(1, 4, (SEQUENCES, 1), generator=g)
        self.ids = (starts + strides * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def write(out: str, name: str, **values) -> None:
    torch.save(values, os.path.join(out, f"{name}-rank{dist.get_rank()}.pt"))


# ---- the Trainer ------------------------------------------------------------------------------
def training_args(directory: str, save: bool, **more) -> TrainingArguments:
    return TrainingArguments(
        **more,
        output_dir=directory,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="steps" if save else "no",
        save_steps=10,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def train(out: str, name: str, algorithm: str | None, resume: str | None = None, **more) -> str:
    """One Trainer run (the Trainer's own DDP when ``algorithm`` is None; ``more``: TrainingArguments);
    its output folder."""
    directory = os.path.join(out, name)
    args = training_args(directory, save=resume is None, **more)
    kwargs = dict(model=gpt2(), args=args, train_dataset=Strides(), eval_dataset=Subset(Strides(), range(32)))
    if algorithm is None:
        trainer = Trainer(**kwargs)
    else:
        trainer = UnisonTrainer(**kwargs, algorithm=algorithm)
    trainer.train(resume_from_checkpoint=resume)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    write(
        out,
        name,
        weights=flat(trainer.model),
        losses=[entry["loss"] for entry in logs],
        eval_losses=[entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
        sent=[entry.get("unison_bytes_sent") for entry in logs],
        wrapped=type(trainer.model_wrapped).__name__,
    )
    return directory


def trainer_modes(out: str, mode: str, algorithm: str | None) -> None:
    if mode == "trainer-ddp":
        train(out, "ddp", None)
        first = train(out, "allreduce", "allreduce")
        train(out, "allreduce-resumed", "allreduce", resume=os.path.join(first, "checkpoint-10"))
        train(out, "ddp-bf16", None, bf16=True)
        train(out, "allreduce-bf16", "allreduce", bf16=True)
        return
    assert algorithm is not None
    name, evaluate = algorithm.partition(":")[0], dict(eval_strategy="steps", eval_steps=10)
    first = train(out, name, algorithm, **evaluate)
    train(out, f"{name}-resumed", algorithm, resume=os.path.join(first, "checkpoint-10"), **evaluate)


# ---- accelerate ----------------------------------------------------------------------------------
def accelerate_loop(out: str, algorithm: str) -> None:
    """The same loop three ways: on UnisonAccelerator (saving its state at step 5), on
    unison.DataParallel directly, and on UnisonAccelerator resumed from the step-5 state."""
    from accelerate.utils import GradientAccumulationPlugin

    batches = list(DataLoader(Strides(), batch_size=BATCH, shuffle=False))
    plugin = GradientAccumulationPlugin(num_steps=ACCUMULATE)

    def with_accelerator(name: str, resume: str | None) -> None:
        accelerator = UnisonAccelerator(algorithm=algorithm, cpu=True, gradient_accumulation_plugin=plugin)
        model = gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loader = DataLoader(Strides(), batch_size=BATCH, shuffle=False)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        start = 0
        if resume is not None:
            accelerator.load_state(resume)
            start = 5
        for i, batch in enumerate(accelerator.skip_first_batches(loader, start * ACCUMULATE)):
            step = start + i // ACCUMULATE
            if step == STEPS:
                break
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
            if resume is None and i == 5 * ACCUMULATE - 1:
                accelerator.save_state(os.path.join(out, "state-5"))
        write(out, name, weights=flat(accelerator.unwrap_model(model)), wrapped=type(model).__name__)

    with_accelerator("accelerate", None)

    rank, world = dist.get_rank(), dist.get_world_size()  # the accelerator started the process group
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    wrapped = unison.DataParallel(model, optimizer=optimizer, algorithm=algorithm)
    mine = batches[rank::world]  # Accelerate's shards: batch i to process i % world
    for step in range(STEPS):
        for k in range(ACCUMULATE):
            batch = mine[step * ACCUMULATE + k]
            if k < ACCUMULATE - 1:
                with wrapped.no_sync():
                    (wrapped(**batch).loss / ACCUMULATE).backward()
            else:
                (wrapped(**batch).loss / ACCUMULATE).backward()
        optimizer.step()
        optimizer.zero_grad()
    write(out, "direct", weights=flat(model))

    with_accelerator("accelerate-resumed", os.path.join(out, "state-5"))


# ---- what is refused -----------------------------------------------------------------------------
def refusals(out: str) -> None:
    """Each bad construction, in a fresh environment: the error's type and message (JSON)."""
    import json

    from accelerate.utils import FullyShardedDataParallelPlugin

    tries = {
        "unknown algorithm": lambda: UnisonAccelerator(algorithm="nope", cpu=True),
        "the accelerator's own argument": lambda: UnisonAccelerator(dataparallel_kwargs={"optimizer": None}, cpu=True),
        "an FSDP plugin": lambda: UnisonAccelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin()),
        "the Trainer's fsdp": lambda: UnisonTrainer(
            model=gpt2(), args=TrainingArguments(os.path.join(out, "fsdp"), use_cpu=True, fsdp="full_shard")
        ),
        "no optimizer in prepare": lambda: UnisonAccelerator(algorithm="diloco", cpu=True).prepare(gpt2()),
    }
    found = {}
    for name, attempt in tries.items():
        os.environ.pop("ACCELERATE_USE_FSDP", None)  # set by Accelerate once an FSDP plugin is given
        try:
            attempt()
            found[name] = None
        except Exception as exc:
            found[name] = [type(exc).__name__, str(exc)]
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(out, "refusals.json"), "w") as f:
            json.dump(found, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="+", help="refusals, trainer-ddp, trainer=ALGORITHM or accelerate=ALGORITHM, in order")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    for run in args.runs:
        mode, _, algorithm = run.partition("=")
        if mode == "refusals":
            refusals(args.out)
        elif mode == "accelerate":
            accelerate_loop(args.out, algorithm)
        else:
            trainer_modes(args.out, mode, algorithm or None)


if __name__ == "__main__":
    main()
