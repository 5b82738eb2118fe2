"""The subcommands that work on a model: `inspect`, `demo`, `estimate-memory`.

retarget inspect tests.zoo:tiny_llama --inputs tests.zoo:lm_inputs --target single --format html
retarget demo --steps 20
retarget estimate-memory tests.zoo:tiny_llama --target fsdp+bf16 --world-size 8
"""

from __future__ import annotations

import argparse
import json

from retarget.cli import choices
from retarget.cli.commands import (
    CliError,
    Handler,
    command,
    compile_errors,
    load_callable,
    parse_target_arg,
    positive_int,
    require_graphviz,
    write_output,
)


@command("inspect", "capture a model for a target and show what each pass did")
def inspect_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget inspect PKG.MODULE:FACTORY --target T [...]`."""
    parser.add_argument(
        "factory", metavar="PKG.MODULE:FACTORY", help="function returning the model (no args)"
    )
    parser.add_argument("--target", default="single", help="target spec, e.g. single (default)")
    parser.add_argument(
        "--inputs",
        metavar="PKG.MODULE:FN",
        help="function returning example inputs: tuple = args, dict = kwargs, else one argument; "
        "without it regions are captured at their first call, so no graphs are shown",
    )
    parser.add_argument(
        "--capture",
        choices=choices.CAPTURE_MODES,
        default="regions",
        help="one graph per repeated block (default), the whole model, or none",
    )
    parser.add_argument(
        "--format",
        choices=choices.FORMATS,
        default="text",
        help="svg needs graphviz; html inlines the svg when graphviz is installed",
    )
    parser.add_argument("--out", metavar="PATH", help="write to PATH instead of stdout")
    parser.add_argument(
        "--world-size",
        type=positive_int,
        help="processes a ddp/fsdp plan is made for (default: this run's world size, else 1)",
    )
    parser.add_argument(
        "--max-nodes",
        type=positive_int,
        default=choices.GRAPH_NODE_CAP,
        help="graph nodes drawn per region (dot, svg, html); the rest fold into one node",
    )
    return run_inspect


def run_inspect(args: argparse.Namespace) -> int:
    """Build the model, compile it for the target and write the report in the chosen format."""
    from torch import nn

    import retarget
    from retarget.report import render

    target = parse_target_arg(args.target)
    if args.format == "svg":
        require_graphviz()  # before the model is built: fail fast
    factory = load_callable(args.factory, "factory")
    make_inputs = load_callable(args.inputs, "inputs") if args.inputs else None
    model = factory()
    if not isinstance(model, nn.Module):
        raise CliError(f"factory {args.factory!r} returned {type(model).__name__}, not nn.Module")
    example = make_inputs() if make_inputs else None
    with compile_errors():
        compiled = retarget.compile_for(
            model,
            target,
            example_inputs=example,
            capture=args.capture,
            world_size=args.world_size,
        )
    try:
        text = render.render(compiled.program, args.format, max_nodes=args.max_nodes)
    except render.GraphvizError as exc:
        raise CliError(str(exc)) from None
    write_output(text, args.out)
    return 0


@command("demo", "train the built-in tiny transformer for a few steps, compiled for a target")
def demo_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget demo [--target T] [--steps N] [--batch B] [--seq S] [--capture MODE]`."""
    parser.add_argument("--target", default="single", help="target spec")
    parser.add_argument("--steps", type=positive_int, default=20, help="optimizer steps")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per batch")
    parser.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence")
    parser.add_argument(
        "--capture", choices=choices.CAPTURE_MODES, default="regions", help="as for inspect"
    )
    return run_demo_command


def run_demo_command(args: argparse.Namespace) -> int:
    """Train TinyLM for `--steps`, then print the report and the first and last loss."""
    from retarget.cli import demo
    from retarget.models import TinyConfig

    target = parse_target_arg(args.target)
    longest = TinyConfig().max_seq
    if not 2 <= args.seq <= longest:  # one token has no next token to predict
        raise CliError(f"--seq must be between 2 and {longest} (TinyLM's rotary tables)")
    with compile_errors():
        result = demo.run_demo(
            target=target, steps=args.steps, batch=args.batch, seq=args.seq, capture=args.capture
        )
    if result.compiled.runtime.is_main_process:  # under `retarget launch`, one rank prints
        print(result.compiled.report)
        print()
        print(result.summary())
    return 0


@command("estimate-memory", "predict a training step's memory per rank for a target")
def estimate_memory_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget estimate-memory PKG.MODULE:FACTORY --target T [--inputs FN] [...]`."""
    parser.add_argument(
        "factory", metavar="PKG.MODULE:FACTORY", help="function returning the model (no args)"
    )
    parser.add_argument("--target", default="single", help="target spec, e.g. fsdp+bf16+ac")
    parser.add_argument(
        "--inputs",
        metavar="PKG.MODULE:FN",
        help="function returning one rank's example batch (as for inspect); without it "
        "activations are unknown",
    )
    parser.add_argument(
        "--world-size",
        type=positive_int,
        help="ranks the target shards over (default: this run's world size, else 1)",
    )
    parser.add_argument(
        "--optimizer",
        choices=choices.OPTIMIZERS,
        default="adam",
        help="the optimizer whose state is counted",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output")
    return run_estimate_memory


def run_estimate_memory(args: argparse.Namespace) -> int:
    """Compile the target's local parts here, profile one forward, print the per-rank table."""
    from torch import nn

    from retarget.driver.estimate import estimate_for_target

    target = parse_target_arg(args.target)
    model = load_callable(args.factory, "factory")()
    if not isinstance(model, nn.Module):
        raise CliError(f"factory {args.factory!r} returned {type(model).__name__}, not nn.Module")
    example = load_callable(args.inputs, "inputs")() if args.inputs else None
    with compile_errors():
        estimate = estimate_for_target(
            model, target, example, world_size=args.world_size, optimizer=args.optimizer
        )
    text = json.dumps(estimate.to_dict(), indent=2) if args.format == "json" else str(estimate)
    write_output(text, None)
    return 0
