"""Profiling: `ProfileKwargs` configures torch.profiler, `with accelerator.profile()` runs it
around the first epoch and writes a Chrome trace per process to `output_trace_dir`.

    python profiler.py --output_dir traces
    python -m torch.distributed.run --nproc_per_node 2 profiler.py --output_dir traces

The operator table differs between libraries that run the model differently; the metrics,
the trace files written and the profiled training steps do not.
"""

import os

from accelerate import Accelerator, ProfileKwargs
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


def main() -> None:
    parser = parse_args(__doc__.splitlines()[0], epochs=2)
    parser.add_argument("--output_dir", default="traces")
    args = parser.parse_args()
    profile_kwargs = ProfileKwargs(
        activities=["cpu"], record_shapes=True, output_trace_dir=args.output_dir
    )
    accelerator = Accelerator(cpu=True, kwargs_handlers=[profile_kwargs])
    set_seed(args.seed)
    model = make_model()
    optimizer = AdamW(model.parameters(), lr=args.lr)
    train_loader, eval_loader = make_loaders(args.batch_size, args.train_samples)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    for epoch in range(args.epochs):
        if epoch == 0:
            with accelerator.profile() as profiler:
                losses = train_one_epoch(accelerator, model, optimizer, train_loader)
            accelerator.print(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=8))
            optimizer_steps = sum(
                event.count
                for event in profiler.key_averages()
                if event.key.startswith("Optimizer.step#")
            )
            print_metrics(accelerator, "profiled", optimizer_steps=optimizer_steps)
        else:
            losses = train_one_epoch(accelerator, model, optimizer, train_loader)
        metrics = evaluate(accelerator, model, eval_loader)
        print_metrics(
            accelerator,
            f"epoch {epoch}",
            train_losses=gathered_losses(accelerator, losses),
            **metrics,
        )
    print_metrics(accelerator, "traces", files=sorted(os.listdir(args.output_dir)))
    del model  # see common.end_training
    end_training(accelerator)


if __name__ == "__main__":
    main()
