"""Experiment tracking: `Accelerator(log_with="tensorboard", project_dir=...)`,
`accelerator.init_trackers`, `accelerator.log` every epoch, `accelerator.end_training()`.

At the end the main process reads the TensorBoard event files back and prints what they hold.

    python tracking.py --output_dir runs
    python -m torch.distributed.run --nproc_per_node 2 tracking.py --output_dir runs
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
    train_one_epoch,
)
from torch.optim import AdamW


def logged_scalars(logging_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the event files under `logging_dir` hold: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    runs = EventMultiplexer().AddRunsFromDirectory(logging_dir)
    runs.Reload()
    return {
        f"{run}/{tag}": [(event.step, event.value) for event in runs.Scalars(run, tag)]
        for run, tags in sorted(runs.Runs().items())
        for tag in sorted(tags["scalars"])
    }


def main() -> None:
    parser = parse_args(__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="runs")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=args.output_dir)
    accelerator.init_trackers("tracking_example", config={"lr": args.lr, "epochs": args.epochs})
    set_seed(args.seed)
    model = make_model()
    optimizer = AdamW(model.parameters(), lr=args.lr)
    train_loader, eval_loader = make_loaders(args.batch_size, args.train_samples)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    for epoch in range(args.epochs):
        losses = gathered_losses(
            accelerator, train_one_epoch(accelerator, model, optimizer, train_loader)
        )
        metrics = evaluate(accelerator, model, eval_loader)
        accelerator.log({"train_loss": sum(losses) / len(losses), **metrics}, step=epoch)
        print_metrics(accelerator, f"epoch {epoch}", train_losses=losses, **metrics)
    del model  # see common.end_training
    end_training(accelerator)
    if accelerator.is_main_process:
        print_metrics(accelerator, "logged", scalars=logged_scalars(args.output_dir))


if __name__ == "__main__":
    main()
