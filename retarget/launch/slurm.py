"""Launch settings derived from a SLURM allocation: one `retarget launch` per node.

Under `srun --ntasks-per-node=1 retarget launch train.py` (docs/slurm.md) each node's launcher
reads the allocation from SLURM's variables, so the script needs no per-node arguments:

    num_machines     SLURM_NNODES (or SLURM_JOB_NUM_NODES)
    machine_rank     SLURM_NODEID
    main_process_ip  the first host of SLURM_JOB_NODELIST ("gpu[01-04,09]" is expanded)
    num_processes    SLURM_NNODES x SLURM_GPUS_ON_NODE, when SLURM gives a GPU count

Flags given on the command line win over these; these win over a config file. The launcher
prints what it derived and from which variables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from retarget.launch.config import LaunchConfig, LaunchError, read_settings

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as host names: "a[1-3,7],b05" -> a1 a2 a3 a7 b05.

    Zero padding is kept ("gpu[08-10]" -> gpu08 gpu09 gpu10); a bracket may appear once per
    host pattern (SLURM's own `scontrol show hostnames` handles more).
    """
    hosts: list[str] = []
    for pattern in _split_top_level(nodelist):
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", pattern)
        if match is None:
            if "[" in pattern or "]" in pattern or not pattern:
                raise LaunchError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read {pattern!r}")
            hosts.append(pattern)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            bounds = _RANGE.fullmatch(item)
            if bounds is None:
                raise LaunchError(f"SLURM_JOB_NODELIST={nodelist!r}: bad range {item!r}")
            low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
            width = len(low)
            for number in range(int(low), int(high) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current += char
    parts.append(current)
    return [p.strip() for p in parts]


def slurm_settings(environ: Mapping[str, str]) -> tuple[LaunchConfig, str] | None:
    """The settings a SLURM allocation implies and a line saying so; None outside SLURM."""
    if "SLURM_JOB_ID" not in environ:
        return None
    nodes_var = "SLURM_NNODES" if "SLURM_NNODES" in environ else "SLURM_JOB_NUM_NODES"
    values: dict[str, str] = {}
    where: dict[str, str] = {}
    if nodes_var in environ:
        values["num_machines"], where["num_machines"] = environ[nodes_var], nodes_var
    if "SLURM_NODEID" in environ:
        values["machine_rank"], where["machine_rank"] = environ["SLURM_NODEID"], "SLURM_NODEID"
    if environ.get("SLURM_JOB_NODELIST"):
        hosts = expand_nodelist(environ["SLURM_JOB_NODELIST"])
        values["main_process_ip"], where["main_process_ip"] = hosts[0], "SLURM_JOB_NODELIST"
    gpus = environ.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and nodes_var in environ and environ[nodes_var].isdigit():
        total = int(environ[nodes_var]) * int(gpus)
        values["num_processes"] = str(total)
        where["num_processes"] = f"{nodes_var} x SLURM_GPUS_ON_NODE"
    if not values:
        return None
    config = read_settings(values, lambda name: where[name])
    said = ", ".join(f"{name}={values[name]} ({where[name]})" for name in values)
    return config, f"from SLURM job {environ['SLURM_JOB_ID']}: {said}"
