"""What every by_feature example shares: a tiny BERT classifier, seeded synthetic data, the
loaders, the evaluation loop and the metric lines.

Only torch and transformers are imported here: each example imports its training library
(`accelerate` or `retarget`) itself, so switching library changes the example's import lines
and nothing else. Functions that need the library take the `accelerator` as an argument.

No network: the model is built from a config with random weights, the data is drawn from a
seeded generator. The task is learnable (is the first half of the tokens' sum larger than the
second half's?), so accuracy moves within a few epochs.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification

VOCAB_SIZE = 64
SEQUENCE_LENGTH = 16
#: Not a multiple of 2 processes x batch size: the last eval batch is uneven, so
#: gather_for_metrics must drop the samples the loader repeated to even the batches out.
EVAL_SAMPLES = 37
DATA_SEED = 1234


def parse_args(description: str, **defaults: object) -> argparse.ArgumentParser:
    """The options every example takes; an example adds its own before `parse_args()`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=defaults.get("epochs", 3))
    parser.add_argument("--batch_size", type=int, default=defaults.get("batch_size", 8))
    parser.add_argument("--train_samples", type=int, default=defaults.get("train_samples", 64))
    parser.add_argument("--lr", type=float, default=defaults.get("lr", 1e-3))
    parser.add_argument("--seed", type=int, default=42)
    return parser


def make_model() -> BertForSequenceClassification:
    """A 2-layer BERT with dropout on (hidden and attention), random weights."""
    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQUENCE_LENGTH,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


class SumComparisonDataset(Dataset):
    """Token ids and labels: label 1 when the first half of the tokens sums higher."""

    def __init__(self, num_samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(
            1, VOCAB_SIZE, (num_samples, SEQUENCE_LENGTH), generator=generator
        )
        half = SEQUENCE_LENGTH // 2
        first, second = self.input_ids[:, :half].sum(1), self.input_ids[:, half:].sum(1)
        self.labels = (first > second).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[index]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": self.labels[index],
        }


def make_datasets(train_samples: int) -> tuple[Dataset, Dataset]:
    """The train and eval sets (disjoint draws of the same task)."""
    return (
        SumComparisonDataset(train_samples, seed=DATA_SEED),
        SumComparisonDataset(EVAL_SAMPLES, seed=DATA_SEED + 1),
    )


def make_loaders(
    batch_size: int, train_samples: int, shuffle_seed: int | None = None
) -> tuple[DataLoader, DataLoader]:
    """A shuffled train loader and an in-order eval loader, not yet prepared. With
    `shuffle_seed` the train loader shuffles with a generator of its own, not torch's global
    one (which dropout also draws from)."""
    train, evaluation = make_datasets(train_samples)
    generator = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, generator=generator),
        DataLoader(evaluation, batch_size=batch_size, shuffle=False),
    )


def train_one_epoch(accelerator, model, optimizer, loader) -> list[torch.Tensor]:
    """The plain loop (forward, accelerator.backward, step); this process's step losses."""
    model.train()
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def reserve_activation_memory(batch_size: int, max_batch_size: int) -> None:
    """Play a device that holds activations for at most `max_batch_size` samples.

    This machine's memory fits any batch here, so a larger batch asks the allocator for more
    memory than any machine has: torch's own out-of-memory error ("DefaultCPUAllocator: can't
    allocate memory"), which find_executable_batch_size recognises as on a real device.
    """
    if batch_size > max_batch_size:
        torch.empty(1 << 62, dtype=torch.uint8)


def evaluate(accelerator, model, loader) -> dict[str, float]:
    """Eval loss and accuracy over exactly the eval set, gathered from every process."""
    model.eval()
    all_logits, all_labels = [], []
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        logits, labels = accelerator.gather_for_metrics((logits, batch["labels"]))
        all_logits.append(logits)
        all_labels.append(labels)
    logits, labels = torch.cat(all_logits), torch.cat(all_labels)
    model.train()
    return {
        "eval_loss": torch.nn.functional.cross_entropy(logits, labels).item(),
        "accuracy": (logits.argmax(-1) == labels).float().mean().item(),
        "eval_samples": len(labels),
    }


def gathered_losses(accelerator, losses: list[torch.Tensor]) -> list[float]:
    """Every process's per-step training losses, process by process."""
    return accelerator.gather(torch.stack(losses).detach()).tolist()


def end_training(accelerator) -> None:
    """`accelerator.end_training()` (which destroys the process group) after the prepared
    models are freed: the caller drops its own references first (`del model`).

    A DDP model keeps its process group alive. Freed after the group is destroyed, at
    interpreter exit, it runs the group's destructor, and torch 2.13's gloo can deadlock there
    (the destructor joins a worker thread that waits for the GIL); seen under Accelerate."""
    accelerator.free_memory()
    accelerator.end_training()


def print_metrics(accelerator, label: str, **metrics: object) -> None:
    """One `METRIC <label> {...}` line on the main process; floats print in full (repr), so
    two runs compare exactly. The tests compare these lines between libraries."""
    accelerator.print(f"METRIC {label} {metrics!r}")
