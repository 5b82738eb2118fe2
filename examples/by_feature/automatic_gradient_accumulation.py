"""Automatic gradient accumulation: when `find_executable_batch_size` lowers the batch, raise
`accelerator.gradient_accumulation_steps` so that each optimizer step still sees the batch
asked for (--batch_size), as far as it divides.

The device is played by `reserve_activation_memory` (common.py), as in memory.py.

    python automatic_gradient_accumulation.py
    python -m torch.distributed.run --nproc_per_node 2 automatic_gradient_accumulation.py
"""

from accelerate import Accelerator, find_executable_batch_size
from accelerate.utils import set_seed
from common import (
    end_training,
    evaluate,
    gathered_losses,
    make_loaders,
    make_model,
    parse_args,
    print_metrics,
    reserve_activation_memory,
)
from torch.optim import AdamW


def main() -> None:
    parser = parse_args(__doc__.splitlines()[0], batch_size=32, train_samples=96)
    parser.add_argument("--max_device_batch_size", type=int, default=8)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)

    @find_executable_batch_size(starting_batch_size=args.batch_size)
    def train(batch_size: int) -> None:
        accelerator.free_memory()
        accelerator.gradient_accumulation_steps = args.batch_size // batch_size
        set_seed(args.seed)
        model = make_model()
        optimizer = AdamW(model.parameters(), lr=args.lr)
        train_loader, eval_loader = make_loaders(batch_size, args.train_samples)
        model, optimizer, train_loader, eval_loader = accelerator.prepare(
            model, optimizer, train_loader, eval_loader
        )
        for epoch in range(args.epochs):
            model.train()
            losses, optimizer_steps = [], 0
            for batch in train_loader:
                reserve_activation_memory(len(batch["labels"]), args.max_device_batch_size)
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    optimizer_steps += int(accelerator.sync_gradients)
                losses.append(loss.detach())
            metrics = evaluate(accelerator, model, eval_loader)
            print_metrics(
                accelerator,
                f"epoch {epoch}",
                batch_size=batch_size,
                gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
                optimizer_steps=optimizer_steps,
                train_losses=gathered_losses(accelerator, losses),
                **metrics,
            )

    train()
    end_training(accelerator)


if __name__ == "__main__":
    main()
