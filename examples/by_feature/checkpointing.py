"""Checkpointing: `accelerator.save_state(folder)` every N optimizer steps, and a second run
that resumes with `accelerator.load_state(folder)` and `accelerator.skip_first_batches`.

    python checkpointing.py --output_dir ckpt
    python checkpointing.py --output_dir ckpt --resume_from_checkpoint ckpt/step_3
    python -m torch.distributed.run --nproc_per_node 2 checkpointing.py --output_dir ckpt

The resumed run prints the same metrics as the uninterrupted one for the epochs it trains.
Accelerate 1.15 does not save the state of a loader's own shuffling generator: resumed in a
later epoch, it shuffles that epoch as epoch 0. retarget replays the saved epoch's shuffle, but
at the very end of an epoch (step_8 here) it too draws the next epoch as Accelerate does.
Within the first epoch (step_3) both continue the uninterrupted run exactly, on 1 and 2
processes; the tests resume there.
"""

import os

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
    parser = parse_args(__doc__.splitlines()[0])
    parser.add_argument("--checkpointing_steps", type=int, default=3)
    parser.add_argument("--output_dir", default="checkpoints")
    parser.add_argument("--resume_from_checkpoint", default=None)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)
    model = make_model()
    optimizer = AdamW(model.parameters(), lr=args.lr)
    # A loader with its own shuffling generator: Accelerate's load_state restores it, so a run
    # resumed mid-epoch sees the batches the uninterrupted run saw. From torch's global RNG,
    # Accelerate would reshuffle the resumed epoch (retarget would not).
    train_loader, eval_loader = make_loaders(args.batch_size, args.train_samples, args.seed)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    completed_steps = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        # The folder's name says how many steps it holds ("step_6").
        completed_steps = int(os.path.basename(args.resume_from_checkpoint).split("_")[1])
    first_epoch, batches_done = divmod(completed_steps, len(train_loader))
    for epoch in range(first_epoch, args.epochs):
        model.train()
        loader = train_loader
        if epoch == first_epoch and batches_done:
            loader = accelerator.skip_first_batches(train_loader, batches_done)
        losses = []
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            completed_steps += 1
            if completed_steps % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
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
