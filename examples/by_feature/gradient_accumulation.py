"""Gradient accumulation: `Accelerator(gradient_accumulation_steps=N)` and
`with accelerator.accumulate(model)`; the optimizer steps every N batches and at the end of
the loader (the last window here is partial: 5 batches per process in one process).

    python gradient_accumulation.py
    python -m torch.distributed.run --nproc_per_node 2 gradient_accumulation.py
"""

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import (
    end_training,
    evaluate,
    gathered_losses,
    make_loaders,
    make_model,
    parse_args,
    print_metrics,
)


def main() -> None:
    parser = parse_args(__doc__.splitlines()[0], train_samples=80)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    args = parser.parse_args()
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=args.gradient_accumulation_steps
    )
    set_seed(args.seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_loader, eval_loader = make_loaders(args.batch_size, args.train_samples)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    for epoch in range(args.epochs):
        model.train()
        losses, optimizer_steps = [], 0
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                optimizer_steps += int(accelerator.sync_gradients)
            losses.append(loss)
        metrics = evaluate(accelerator, model, eval_loader)
        print_metrics(
            accelerator,
            f"epoch {epoch}",
            train_losses=gathered_losses(accelerator, losses),
            optimizer_steps=optimizer_steps,
            **metrics,
        )
    del model  # see common.end_training
    end_training(accelerator)


if __name__ == "__main__":
    main()
