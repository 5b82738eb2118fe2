"""The choices and defaults the subcommands' options show in `--help`, written out here.

`retarget --help` must answer without importing torch (seconds on a cold start), and the
constants these mirror live in modules that import it. tests/cli/test_cli_startup.py checks
each value here equals the library's own, so they cannot drift apart.
"""

from __future__ import annotations

#: retarget.passes.capture.capture_regions.MODES
CAPTURE_MODES = ("regions", "auto", "whole", "eager")
#: retarget.report.render.FORMATS
FORMATS = ("text", "json", "dot", "svg", "html")
#: retarget.report.dot_figure.GRAPH_NODE_CAP
GRAPH_NODE_CAP = 400
#: the keys of retarget.report.memory_estimate.OPTIMIZERS
OPTIMIZERS = ("adam", "adamw", "sgd", "none")
#: retarget.passes.place.device_map.MODES
DEVICE_MAP_MODES = ("auto", "balanced", "sequential")
