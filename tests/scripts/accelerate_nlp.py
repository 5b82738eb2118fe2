"""BERT sequence classification in the shape of Accelerate's nlp_example / checkpointing example,
with `from retarget import Accelerator` (the only line that differs from the Accelerate version).

A tiny BertForSequenceClassification (random init from a small config) on synthetic token
sequences whose label is learnable (does token 7 occur more often than token 9?). Gradient
accumulation through `accumulate()`, clip_grad_norm_ on synchronising steps, a linear warmup
scheduler, and `save_state` every `--checkpointing_steps` micro-batches; `--resume_from_checkpoint`
continues a run from such a folder, skipping the batches it had already trained on. Losses are
printed exactly (repr), so tests/compat/accelerate/test_accelerator.py can check that a resumed
run continues the uninterrupted one number for number.
"""

import argparse
import os

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from retarget import Accelerator

SEQ = 16
VOCAB = 64


class SyntheticPairs(Dataset):
    """`n` samples of `input_ids`, `attention_mask`, `labels` (2 classes)."""

    def __init__(self, n, seed):
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, VOCAB, (n, SEQ), generator=generator)
        counts = [(self.input_ids == token).sum(dim=1) for token in (7, 9)]
        self.labels = (counts[0] > counts[1]).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[i]}


def get_dataloaders(batch_size):
    train = DataLoader(SyntheticPairs(96, seed=1), shuffle=True, batch_size=batch_size)
    evaluation = DataLoader(SyntheticPairs(40, seed=2), shuffle=False, batch_size=batch_size)
    return train, evaluation


def training_function(config, args):
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=config["gradient_accumulation_steps"],
    )
    torch.manual_seed(config["seed"])
    train_dataloader, eval_dataloader = get_dataloaders(config["batch_size"])
    bert = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    model = BertForSequenceClassification(bert)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
    num_epochs = config["num_epochs"]
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=2,
        num_training_steps=len(train_dataloader) * num_epochs,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        path = os.path.basename(args.resume_from_checkpoint)
        resume_step = int(path.replace("step_", ""))
        starting_epoch = resume_step // len(train_dataloader)
        overall_step = resume_step
        resume_step -= starting_epoch * len(train_dataloader)

    for epoch in range(starting_epoch, num_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            accelerator.print(f"step {overall_step} loss {loss.item()!r}")
            if overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))

        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total!r} on {total}")
    accelerator.print(f"lr {lr_scheduler.get_last_lr()[0]!r}")


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None)
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--checkpointing_steps", type=int, default=4)
    parser.add_argument("--output_dir", type=str, default=".")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    args = parser.parse_args()
    config = {
        "lr": 2e-3,
        "num_epochs": 2,
        "seed": 42,
        "batch_size": 8,
        "gradient_accumulation_steps": 2,
    }
    training_function(config, args)


if __name__ == "__main__":
    main()
