"""`retarget device-map`: the device map a model would get, built without its weights.

retarget device-map tests.bigmodel_models:llama_model --max-memory cpu=300KB --mode sequential
"""

from __future__ import annotations

import argparse
import json

from retarget.cli.choices import DEVICE_MAP_MODES
from retarget.cli.commands import CliError, Handler, command, load_callable, write_output


@command("device-map", "plan where each module of a model goes under memory budgets")
def device_map_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget device-map PKG.MODULE:FACTORY --max-memory DEV=SIZE ... [...]`."""
    parser.add_argument(
        "factory",
        metavar="PKG.MODULE:FACTORY",
        help="function returning the model (no args); called under init_empty_weights",
    )
    parser.add_argument(
        "--max-memory",
        action="append",
        default=[],
        metavar="DEVICE=SIZE",
        help="a budget, e.g. cpu=70MB or 0=10GiB (repeat per device; default: free memory)",
    )
    parser.add_argument(
        "--mode",
        choices=DEVICE_MAP_MODES,
        default="auto",
        help="how blocks are spread over the devices",
    )
    parser.add_argument("--dtype", help="floating dtype the weights will be loaded in")
    parser.add_argument(
        "--no-split", action="append", default=[], metavar="CLASS", help="class never split"
    )
    parser.add_argument("--inputs", metavar="PKG.MODULE:FN", help="example batch for headroom")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output")
    return run_device_map


def run_device_map(args: argparse.Namespace) -> int:
    from torch import nn

    from retarget.bigmodel.empty_init import init_empty_weights
    from retarget.core.placement import PlacementError
    from retarget.passes.place.device_map import infer_auto_device_map

    budgets = {}
    for item in args.max_memory:
        device, sep, size = item.partition("=")
        if not sep:
            raise CliError(f"--max-memory {item!r}: write DEVICE=SIZE, e.g. cpu=70MB")
        budgets[int(device) if device.isdigit() else device] = size
    with init_empty_weights():
        model = load_callable(args.factory, "factory")()
    if not isinstance(model, nn.Module):
        raise CliError(f"factory {args.factory!r} returned {type(model).__name__}, not nn.Module")
    example = load_callable(args.inputs, "inputs")() if args.inputs else None
    try:
        plan = infer_auto_device_map(
            model,
            max_memory=budgets or None,
            no_split_module_classes=args.no_split or None,
            dtype=args.dtype,
            mode=args.mode,
            example_inputs=example,
        )
    except PlacementError as error:
        raise CliError(str(error)) from error
    if args.format == "json":
        text = json.dumps({"device_map": dict(plan), "sizes": plan.sizes}, indent=2)
    else:
        text = str(plan)
    write_output(text, None)
    return 0
