"""Memory: `find_executable_batch_size` retries the training with a smaller batch after an
out-of-memory error, freeing what the failed try prepared (`accelerator.free_memory()`).

The device is played by `reserve_activation_memory` (common.py): batches over
--max_device_batch_size fail with torch's own CPU out-of-memory error.

    python memory.py
    python -m torch.distributed.run --nproc_per_node 2 memory.py
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
    parser = parse_args(__doc__.splitlines()[0], batch_size=32)
    parser.add_argument("--max_device_batch_size", type=int, default=12)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    tried = []

    @find_executable_batch_size(starting_batch_size=args.batch_size)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        accelerator.free_memory()  # what the failed try prepared
        set_seed(args.seed)
        model = make_model()
        optimizer = AdamW(model.parameters(), lr=args.lr)
        train_loader, eval_loader = make_loaders(batch_size, args.train_samples)
        model, optimizer, train_loader, eval_loader = accelerator.prepare(
            model, optimizer, train_loader, eval_loader
        )
        for epoch in range(args.epochs):
            model.train()
            losses = []
            for batch in train_loader:
                reserve_activation_memory(len(batch["labels"]), args.max_device_batch_size)
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
            metrics = evaluate(accelerator, model, eval_loader)
            print_metrics(
                accelerator,
                f"epoch {epoch}",
                batch_size=batch_size,
                train_losses=gathered_losses(accelerator, losses),
                **metrics,
            )

    train()
    print_metrics(accelerator, "batch sizes tried", tried=tried)
    end_training(accelerator)


if __name__ == "__main__":
    main()
