"""DDP communication hooks: `DistributedDataParallelKwargs(comm_hook=...)` all-reduces the
gradients in fp16 (or bf16, or PowerSGD's low-rank form) instead of fp32.

With one process there is no gradient communication and the hook has nothing to do.

    python ddp_comm_hook.py
    python -m torch.distributed.run --nproc_per_node 2 ddp_comm_hook.py --comm_hook fp16
"""

from accelerate import Accelerator, DDPCommunicationHookType, DistributedDataParallelKwargs
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
    parser = parse_args(__doc__.splitlines()[0])
    parser.add_argument(
        "--comm_hook", default="fp16", choices=[hook.value for hook in DDPCommunicationHookType]
    )
    args = parser.parse_args()
    ddp_kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(args.comm_hook))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ddp_kwargs])
    set_seed(args.seed)
    model = make_model()
    optimizer = AdamW(model.parameters(), lr=args.lr)
    train_loader, eval_loader = make_loaders(args.batch_size, args.train_samples)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    for epoch in range(args.epochs):
        losses = train_one_epoch(accelerator, model, optimizer, train_loader)
        metrics = evaluate(accelerator, model, eval_loader)
        print_metrics(
            accelerator,
            f"epoch {epoch}",
            train_losses=gathered_losses(accelerator, losses),
            **metrics,
        )
    del model  # see common.end_training
    end_training(accelerator)


if __name__ == "__main__":
    main()
