"""`retarget launch`: run a training script on N processes, torchrun underneath.

    retarget launch --num_processes 2 train.py --lr 3e-4     # everything after train.py is its own

is, on one machine,

    python -m torch.distributed.run --nproc_per_node 2 --nnodes 1 --node_rank 0 \\
        --master_addr 127.0.0.1 --master_port <a free port> train.py --lr 3e-4

with each rank started through `worker.py` (which records a rank's exception for the
summary below). `--num_processes 1` runs `python train.py ...` directly, no torchrun.

Flags are Accelerate's (`--num_processes`, `--num_machines`, `--machine_rank`,
`--main_process_ip`, `--main_process_port`, `--mixed_precision`, `--config_file`, also spelled
with dashes), plus `--target` (`--dynamo_*`: the target's compile part, dynamo_flags.py; the
rest of Accelerate's flags: accelerate_flags.py; the parser: command_line.py). Each
setting comes from the first of: its flag, the config file
(`--config_file`, else `$RETARGET_CONFIG`, else ~/.cache/retarget/default_config.yaml when it
exists; `retarget.launch.config`), the default. Defaults: 1 process on 1 machine; target
`single` for one process and `ddp` for more; mixed precision as the target says.

The target in effect is exported to the script as `RETARGET_TARGET` (mixed precision folded
in: `--target fsdp --mixed_precision bf16` gives `fsdp+bf16`); `launched_target()` reads it.

Bad settings, a missing config file or script, a target part whose options no pass can realise
(every part's options are read as the passes read them): a `LaunchError` before anything starts.
`cpu_ram_efficient_loading=true` also exports the variables that make transformers'
from_pretrained load weights on local rank 0 only (execution/rank0_loading.py). When a
rank fails, torchrun stops the others (SIGTERM, SIGKILL after 30 s) even when they wait in a
collective, and the launcher ends with `rank 1 failed: ValueError: ...` and exit code 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from retarget.core.world import TARGET_ENV
from retarget.launch.accelerate_flags import AccelerateFlags, with_precision_flags
from retarget.launch.config import (
    LaunchConfig,
    LaunchError,
    check_combination,
    config_in_effect,
    merged,
    read_launch_config,
)
from retarget.launch.dynamo_flags import DynamoFlags, with_dynamo_flags
from retarget.launch.failures import cause, failure_summary
from retarget.launch.progress import progress_dir, stalled_lines
from retarget.launch.reachability import DEFAULT_JOIN_TIMEOUT_S, check_port_free, wait_for_main
from retarget.launch.signals import relay_usr1, stopped_dir, stopped_ranks
from retarget.launch.slurm import slurm_settings
from retarget.targets.grammar import Target
from retarget.targets.precisions import with_precision

__all__ = ["LaunchPlan", "rank_command", "resolve", "run", "torchrun_args"]

WORKER = Path(__file__).with_name("worker.py")
MULTI_MACHINE_PORT = 29500  # torchrun's default master port


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Everything decided before launching: what runs, where, and for which target."""

    script: str
    """Path of the training script."""
    script_args: tuple[str, ...] = ()
    """Its arguments, passed untouched."""
    target: Target
    """The target in effect, exported as RETARGET_TARGET."""
    target_origin: str = "default"
    """Where the target came from, for the launch line."""
    num_processes: int = 1
    """Processes over all machines."""
    num_machines: int = 1
    """Machines (torchrun nodes)."""
    machine_rank: int = 0
    """This machine's rank."""
    main_process_ip: str = "127.0.0.1"
    """Rendezvous address (the rank-0 machine)."""
    main_process_port: int = MULTI_MACHINE_PORT
    """Rendezvous port."""
    rdzv_backend: str = "static"
    """torchrun rendezvous backend."""
    max_restarts: int = 0
    join_timeout: int = DEFAULT_JOIN_TIMEOUT_S
    """Restarts of the whole worker group after a rank fails (torchrun's elastic agent)."""
    use_cpu: bool = False
    """Hide accelerators from the script."""
    gpu_ids: str | None = None
    """Devices of this machine the script sees; None: all."""
    config_file: str | None = None
    """The config file read, if any."""
    derived: str = ""
    """What was derived from the environment (a SLURM allocation), for the launch line."""
    run_as: str = "script"
    """How a rank starts `script`: "script" (python), "module" (python -m), "program" (as is)."""
    torchrun_options: tuple[str, ...] = ()
    """torchrun flags passed through (--tee, --log_dir, --role, --monitor_interval, --rdzv_conf)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """More variables for the script (Accelerate's, e.g. ACCELERATE_GRADIENT_ACCUMULATION_STEPS)."""

    @property
    def nproc_per_node(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def direct(self) -> bool:
        """One process on one machine, never restarted: run the script without torchrun."""
        return self.num_processes == 1 and not self.max_restarts


def resolve(
    script: str,
    script_args: Sequence[str] = (),
    *,
    flags: LaunchConfig | None = None,
    config_file: str | os.PathLike[str] | None = None,
    dynamo: DynamoFlags | None = None,
    accelerate: AccelerateFlags | None = None,
    run_as: str = "script",
) -> LaunchPlan:
    """Decide the launch: flags over the config file in effect over defaults; raises LaunchError.

    Nothing is started; `run(plan)` starts it.
    """
    path = config_in_effect(config_file)
    slurm = slurm_settings(os.environ)
    layers = [flags or LaunchConfig()] + ([slurm[0]] if slurm else [])
    layers += [read_launch_config(path)] if path else []
    settings = merged(layers)
    processes, machines = settings.num_processes or 1, settings.num_machines or 1
    target, origin = with_dynamo_flags(*_target_in_effect(settings, processes), dynamo)
    target, origin = with_precision_flags(target, origin, accelerate)
    final = replace(settings, target=target, num_processes=processes, num_machines=machines)
    check_combination(final)
    check_target_parts(target, origin, path)
    if machines > 1 and not final.main_process_ip:
        raise LaunchError(
            f"{final.origin('num_machines')} is {machines}: set --main_process_ip (or "
            "main_process_ip in the config file) to the address of the rank-0 machine"
        )
    if run_as == "script" and not Path(script).is_file():
        raise LaunchError(f"script {script!r} does not exist (or is not a file)")
    port = final.main_process_port or (_free_port() if machines == 1 else MULTI_MACHINE_PORT)
    hosts_store = (final.machine_rank or 0) == 0 and (final.rdzv_backend or "static") == "static"
    if hosts_store and (processes > 1 or final.max_restarts) and final.main_process_port:
        check_port_free(port, final.origin("main_process_port"))
    elif hosts_store and machines > 1:
        check_port_free(port, "main_process_port (default)")
    return LaunchPlan(
        script=script,
        script_args=tuple(script_args),
        target=target,
        target_origin=origin,
        num_processes=processes,
        num_machines=machines,
        machine_rank=final.machine_rank or 0,
        main_process_ip=final.main_process_ip or "127.0.0.1",
        main_process_port=port,
        rdzv_backend=final.rdzv_backend or "static",
        max_restarts=final.max_restarts or 0,
        join_timeout=final.join_timeout or DEFAULT_JOIN_TIMEOUT_S,
        use_cpu=bool(final.use_cpu),
        gpu_ids=None if final.gpu_ids in (None, "all") else final.gpu_ids,
        config_file=None if path is None else str(path),
        derived=slurm[1] if slurm else "",
        run_as=run_as,
        torchrun_options=accelerate.torchrun if accelerate else (),
        env=dict(accelerate.env) if accelerate else {},
    )


def check_target_parts(target: Target, origin: str, config_file: Path | None = None) -> None:
    """Read every part's options as compile_for's passes will (no model is needed), so an
    option no pass realises stops the launch here, not every rank after start-up. The message
    names the config file's keys that set the options it names (Accelerate's `fsdp_*`)."""
    from retarget.core.errors import TargetNotSupportedError
    from retarget.passes.pipeline import build_pipeline
    from retarget.targets.grammar import TargetError

    try:
        build_pipeline(target)
    except (TargetNotSupportedError, TargetError, ValueError) as error:
        keys = _keys_named(config_file, str(error)) if config_file is not None else []
        where = f"; set by {', '.join(keys)} in {config_file}" if keys else ""
        raise LaunchError(
            f"target '{target}' ({origin}) would be refused by every rank: {error}{where}"
        ) from None


def _keys_named(config_file: Path, message: str) -> list[str]:
    """The file's section keys (`fsdp_config: fsdp_<option>`) whose option `message` names."""
    import yaml

    try:
        document = yaml.safe_load(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return []
    found = []
    for section, keys in (document or {}).items():
        if not (isinstance(keys, dict) and section.endswith("_config")):
            continue
        prefix = section.removesuffix("config")
        for key in keys:
            option = str(key).removeprefix(prefix)
            if f"{option}=" in message or f"{option} " in message:
                found.append(f"{section}: {key}")
    return found


def _target_in_effect(settings: LaunchConfig, processes: int) -> tuple[Target, str]:
    """The target and where it came from; without one, single for 1 process, else ddp."""
    if settings.target is not None:
        return settings.target, settings.origin("target")
    target = Target.parse("ddp" if processes > 1 else "single")
    origin = f"default for {processes} process{'es' if processes > 1 else ''}"
    if settings.mixed_precision:
        target = with_precision(target, settings.mixed_precision)
        origin += f" with {settings.origin('mixed_precision')} {settings.mixed_precision}"
    return target, origin


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_args(plan: LaunchPlan) -> list[str]:
    """The arguments of `python -m torch.distributed.run` (torchrun) for `plan`."""
    args = ["--nproc_per_node", str(plan.nproc_per_node), "--nnodes", str(plan.num_machines)]
    args += ["--node_rank", str(plan.machine_rank)]
    if plan.rdzv_backend == "static":
        args += [
            "--master_addr",
            plan.main_process_ip,
            "--master_port",
            str(plan.main_process_port),
        ]
    else:
        endpoint = f"{plan.main_process_ip}:{plan.main_process_port}"
        args += ["--rdzv_backend", plan.rdzv_backend, "--rdzv_endpoint", endpoint]
    if plan.max_restarts:
        args += ["--max_restarts", str(plan.max_restarts)]
    passed = list(plan.torchrun_options)
    if plan.num_machines > 1:  # static reads `timeout`, c10d `join_timeout`
        conf = f"timeout={plan.join_timeout},join_timeout={plan.join_timeout}"
        if "--rdzv_conf" in passed:  # the user's keys after ours: theirs win
            at = passed.index("--rdzv_conf") + 1
            passed[at] = f"{conf},{passed[at]}"
        else:
            passed += ["--rdzv_conf", conf]
    args += passed
    # --no_python: torchrun runs `python -u worker.py script args` as each rank's command.
    args += ["--no_python", *rank_command(plan)]
    return args


def rank_command(plan: LaunchPlan) -> list[str]:
    """What each rank runs: the worker around the script or module, or the program itself."""
    if plan.run_as == "program":
        return [plan.script, *plan.script_args]
    module = ["-m"] if plan.run_as == "module" else []
    return [sys.executable, "-u", str(WORKER), *module, plan.script, *plan.script_args]


def worker_env(plan: LaunchPlan) -> dict[str, str]:
    """Variables the script's processes get on top of the launcher's environment."""
    from retarget.execution.rank0_loading import TRANSFORMERS_ENV, asks_rank0_loading

    env = {**plan.env, TARGET_ENV: str(plan.target)}
    if asks_rank0_loading(plan.target):  # transformers then loads on local rank 0 only
        env.update(TRANSFORMERS_ENV)
    if plan.use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif plan.gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.gpu_ids
    return env


def describe(plan: LaunchPlan) -> str:
    """One line saying what is launched, for the launcher's stderr."""
    machines = f"{plan.num_machines} machine{'s' if plan.num_machines > 1 else ''}"
    rendezvous = f"{plan.main_process_ip}:{plan.main_process_port}"
    how = "directly" if plan.direct else f"torchrun on {rendezvous}"
    return (
        f"retarget launch: {plan.script} on {plan.num_processes} process"
        f"{'es' if plan.num_processes > 1 else ''} ({machines}, {how}), launched target "
        f"{plan.target} ({plan.target_origin}; what compile_for and the Accelerator use when the "
        f"script names none), config {plan.config_file or 'none'}"
        + (f"; {plan.derived}" if plan.derived else "")
    )


def run(plan: LaunchPlan) -> int:
    """Run the plan to the end; returns the exit code (non-zero when any rank failed, 0 when
    every rank stopped cleanly after a preemption signal)."""
    with _environment(worker_env(plan)), stopped_dir() as stopped, relay_usr1():
        if plan.direct:
            return _run_direct(plan)
        if plan.machine_rank > 0:
            try:
                origin = "main_process_ip/main_process_port"
                wait_for_main(
                    plan.main_process_ip, plan.main_process_port, plan.join_timeout, origin
                )
            except LaunchError as error:
                print(f"retarget launch: {error}", file=sys.stderr)
                return 1
        with progress_dir() as progress:
            return _run_torchrun(plan, stopped, progress)


@contextlib.contextmanager
def _environment(extra: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `extra` set; restored afterwards (torchrun's ranks inherit os.environ)."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128 + N


def _run_direct(plan: LaunchPlan) -> int:
    how = {"script": [sys.executable], "module": [sys.executable, "-m"], "program": []}
    process = subprocess.Popen([*how[plan.run_as], plan.script, *plan.script_args])
    # Ctrl-C reaches the script from the terminal too: wait for it to finish, do not orphan it.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: process.terminate())
    try:
        while True:
            with contextlib.suppress(KeyboardInterrupt):
                return _exit_code(process.wait())
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_torchrun(plan: LaunchPlan, stopped: Path, progress: Path) -> int:
    # torchrun in this process (as Accelerate runs it): its ChildFailedError says which rank
    # failed and how, which `python -m torch.distributed.run` would only print.
    from torch.distributed import DistError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        torchrun.run(torchrun.parse_args(torchrun_args(plan)))
    except ChildFailedError as failed:
        lines = failure_summary(failed.failures)
        causes = " ".join(cause(f, limit=10**6) for f in failed.failures.values()).lower()
        if "timed out" in causes or "timeout" in causes:  # a hang: say who stopped moving
            lines += stalled_lines(progress)
        for line in lines:
            print(f"retarget launch: {line}", file=sys.stderr)
        return 1
    except (DistError, RendezvousError) as error:  # the rendezvous itself failed
        where = f"{plan.main_process_ip}:{plan.main_process_port}"
        first = " ".join(str(error).split())[:300]
        print(
            f"retarget launch: the rendezvous at {where} ({plan.rdzv_backend}) failed: "
            f"{type(error).__name__}: {first}",
            file=sys.stderr,
        )
        return 1
    except SignalException as signalled:  # the launcher itself was interrupted or terminated
        name = signalled.sigval.name
        if stopped_ranks(stopped) == plan.nproc_per_node:
            print(
                f"retarget launch: preempted by {name}: every rank saved and stopped",
                file=sys.stderr,
            )
            return 0
        print(f"retarget launch: stopped by {name}", file=sys.stderr)
        return 128 + int(signalled.sigval)
    return 0
