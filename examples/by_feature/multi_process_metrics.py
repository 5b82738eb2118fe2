"""Metrics over several processes: each process evaluates its share, and
`accelerator.gather_for_metrics` returns exactly the eval set's samples, dropping those the
prepared loader repeated so that every process gets a full last batch.

The eval set (37 samples) does not split evenly over 2 processes x batches of 8. The same
count done by hand with `accelerator.gather` shows what gather_for_metrics saves you.

    python multi_process_metrics.py
    python -m torch.distributed.run --nproc_per_node 2 multi_process_metrics.py
"""

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import (
    end_training,
    gathered_losses,
    make_loaders,
    make_model,
    parse_args,
    print_metrics,
    train_one_epoch,
)
from torch.optim import AdamW


def count_correct(accelerator, model, loader) -> dict[str, int]:
    model.eval()
    for_metrics = {"correct": 0, "samples": 0}
    by_hand = {"correct": 0, "samples": 0}
    samples_seen = 0
    for step, batch in enumerate(loader):
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(-1)
        gathered = accelerator.gather_for_metrics((predictions, batch["labels"]))
        for_metrics["correct"] += int((gathered[0] == gathered[1]).sum())
        for_metrics["samples"] += len(gathered[1])
        predictions, labels = accelerator.gather((predictions, batch["labels"]))
        if step == len(loader) - 1:
            # The last batch holds repeated samples: keep only those not yet seen.
            predictions = predictions[: len(loader.dataset) - samples_seen]
            labels = labels[: len(loader.dataset) - samples_seen]
        samples_seen += len(labels)
        by_hand["correct"] += int((predictions == labels).sum())
        by_hand["samples"] += len(labels)
    model.train()
    return {"gather_for_metrics": for_metrics, "gather_by_hand": by_hand}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0]).parse_args()
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)
    model = make_model()
    optimizer = AdamW(model.parameters(), lr=args.lr)
    train_loader, eval_loader = make_loaders(args.batch_size, args.train_samples)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    for epoch in range(args.epochs):
        losses = train_one_epoch(accelerator, model, optimizer, train_loader)
        counts = count_correct(accelerator, model, eval_loader)
        print_metrics(
            accelerator,
            f"epoch {epoch}",
            train_losses=gathered_losses(accelerator, losses),
            **counts,
        )
    del model  # see common.end_training
    end_training(accelerator)


if __name__ == "__main__":
    main()
