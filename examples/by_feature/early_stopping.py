"""Early stopping across processes: a process that sees a training loss below the threshold
calls `accelerator.set_trigger()`; `accelerator.check_trigger()` is then True on every
process at the same step, so all of them leave the loop together.

    python early_stopping.py
    python -m torch.distributed.run --nproc_per_node 2 early_stopping.py
"""

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
from torch.optim import AdamW


def main() -> None:
    parser = parse_args(__doc__.splitlines()[0], epochs=4)
    parser.add_argument("--loss_threshold", type=float, default=0.67)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)
    model = make_model()
    optimizer = AdamW(model.parameters(), lr=args.lr)
    train_loader, eval_loader = make_loaders(args.batch_size, args.train_samples)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    stopped = None
    for epoch in range(args.epochs):
        model.train()
        losses = []
        for step, batch in enumerate(train_loader):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            if loss.item() < args.loss_threshold:
                accelerator.set_trigger()
            if accelerator.check_trigger():
                stopped = {"epoch": epoch, "step": step}
                break
        metrics = evaluate(accelerator, model, eval_loader)
        print_metrics(
            accelerator,
            f"epoch {epoch}",
            train_losses=gathered_losses(accelerator, losses),
            **metrics,
        )
        if stopped:
            break
    print_metrics(accelerator, "stopped", at=stopped)
    del model  # see common.end_training
    end_training(accelerator)


if __name__ == "__main__":
    main()
