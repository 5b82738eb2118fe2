"""Local SGD: each process trains without gradient communication and the parameters are
averaged over processes every `local_sgd_steps` optimizer steps (`LocalSGD`).

    python local_sgd.py
    python -m torch.distributed.run --nproc_per_node 2 local_sgd.py --local_sgd_steps 2
"""

from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
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
    parser = parse_args(__doc__.splitlines()[0])
    parser.add_argument("--local_sgd_steps", type=int, default=3)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)
    model = make_model()
    optimizer = AdamW(model.parameters(), lr=args.lr)
    train_loader, eval_loader = make_loaders(args.batch_size, args.train_samples)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    for epoch in range(args.epochs):
        model.train()
        losses = []
        with LocalSGD(
            accelerator=accelerator, model=model, local_sgd_steps=args.local_sgd_steps
        ) as local_sgd:
            for batch in train_loader:
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
                losses.append(loss.detach())
        metrics = evaluate(accelerator, model, eval_loader)
        print_metrics(
            accelerator,
            f"epoch {epoch}",
            train_losses=gathered_losses(accelerator, losses),
            **metrics,
        )
    del model, local_sgd  # LocalSGD holds the model too; see common.end_training
    end_training(accelerator)


if __name__ == "__main__":
    main()
