"""`retarget convert-checkpoint`: a retarget checkpoint folder as Accelerate's, to go back.

retarget convert-checkpoint runs/llama/checkpoints/checkpoint_3 runs/llama/accelerate_3
"""

from __future__ import annotations

import argparse

from retarget.cli.commands import CliError, Handler, command


@command(
    "convert-checkpoint",
    "write a save_state folder in Accelerate's layout (accelerate's load_state reads it)",
)
def convert_checkpoint_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget convert-checkpoint SOURCE DESTINATION [--to accelerate]`."""
    parser.add_argument("source", metavar="SOURCE", help="a complete retarget checkpoint folder")
    parser.add_argument(
        "destination", metavar="DESTINATION", help="a new (or empty) folder to write"
    )
    parser.add_argument(
        "--to",
        choices=("accelerate",),
        default="accelerate",
        help="the layout to write: Accelerate 1.x's save_state files",
    )
    return run_convert_checkpoint


def run_convert_checkpoint(args: argparse.Namespace) -> int:
    """Convert, then print what was written and what was not carried over."""
    from retarget.compat.accelerate.checkpoint_export import write_accelerate_checkpoint
    from retarget.runtime.state.folder import CheckpointError

    try:
        done = write_accelerate_checkpoint(args.source, args.destination)
    except CheckpointError as error:
        raise CliError(str(error), code=1) from None
    print(done.summary())
    return 0
