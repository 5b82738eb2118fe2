"""Cross-validation: k folds of the training set, a fresh model prepared per fold
(`accelerator.free_memory()` between folds), each fold's test predictions gathered with
`gather_for_metrics`, and the folds' averaged logits scored as an ensemble.

    python cross_validation.py
    python -m torch.distributed.run --nproc_per_node 2 cross_validation.py --num_folds 3
"""

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import (
    end_training,
    gathered_losses,
    make_datasets,
    make_model,
    parse_args,
    print_metrics,
    train_one_epoch,
)
from torch.optim import AdamW
from torch.utils.data import DataLoader, Subset


def predict(accelerator, model, loader) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels of the whole set, from every process."""
    model.eval()
    logits, labels = [], []
    for batch in loader:
        with torch.no_grad():
            gathered = accelerator.gather_for_metrics((model(**batch).logits, batch["labels"]))
        logits.append(gathered[0])
        labels.append(gathered[1])
    return torch.cat(logits), torch.cat(labels)


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return (logits.argmax(-1) == labels).float().mean().item()


def main() -> None:
    parser = parse_args(__doc__.splitlines()[0], epochs=2, train_samples=72)
    parser.add_argument("--num_folds", type=int, default=3)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    train_set, test_set = make_datasets(args.train_samples)
    folds = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed))
    folds = folds.chunk(args.num_folds)
    test_logits = []
    for fold, held_out in enumerate(folds):
        kept = torch.cat([f for i, f in enumerate(folds) if i != fold])
        accelerator.free_memory()
        set_seed(args.seed + fold)
        model = make_model()
        optimizer = AdamW(model.parameters(), lr=args.lr)
        loaders = (
            DataLoader(Subset(train_set, kept.tolist()), batch_size=args.batch_size, shuffle=True),
            DataLoader(Subset(train_set, held_out.tolist()), batch_size=args.batch_size),
            DataLoader(test_set, batch_size=args.batch_size),
        )
        model, optimizer, train_loader, valid_loader, test_loader = accelerator.prepare(
            model, optimizer, *loaders
        )
        for epoch in range(args.epochs):
            losses = train_one_epoch(accelerator, model, optimizer, train_loader)
            print_metrics(
                accelerator,
                f"fold {fold} epoch {epoch}",
                train_losses=gathered_losses(accelerator, losses),
                valid_accuracy=accuracy(*predict(accelerator, model, valid_loader)),
            )
        logits, test_labels = predict(accelerator, model, test_loader)
        test_logits.append(logits)
        print_metrics(accelerator, f"fold {fold} test", accuracy=accuracy(logits, test_labels))
    ensemble = torch.stack(test_logits).mean(0)
    print_metrics(accelerator, "ensemble test", accuracy=accuracy(ensemble, test_labels))
    del model  # see common.end_training
    end_training(accelerator)


if __name__ == "__main__":
    main()
