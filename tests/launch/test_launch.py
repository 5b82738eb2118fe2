"""`retarget launch` (retarget/launch/launcher.py, launch_worker.py): settings precedence, the
torchrun command, bad input refused before launching, the failure summary, and four real
launches (2 ranks; a failing rank; one process run directly; the MNIST tutorial script)."""

from __future__ import annotations

import difflib
import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from retarget.cli.main import build_parser, main
from retarget.core.world import TARGET_ENV, launched_target
from retarget.launch import worker as launch_worker
from retarget.launch.command_line import plan_from_args
from retarget.launch.config import CONFIG_ENV, LaunchConfig, read_settings
from retarget.launch.failures import failure_summary
from retarget.launch.launcher import (
    WORKER,
    resolve,
    torchrun_args,
    worker_env,
)
from retarget.targets.grammar import Target, TargetError
from tests.paths import REPO

SCRIPTS = REPO / "tests" / "scripts"


@pytest.fixture(autouse=True)
def _isolated_home(monkeypatch, tmp_path):
    """No real ~/.cache/retarget, $RETARGET_CONFIG or $RETARGET_TARGET leaks into a test."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv(TARGET_ENV, raising=False)


@pytest.fixture
def script(tmp_path) -> Path:
    """A script that leaves a marker file when it runs: it must not run for bad input."""
    path = tmp_path / "train.py"
    path.write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n")
    return path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def flags(**values: str) -> LaunchConfig:
    """Settings as if given as `--name value` flags."""
    return read_settings(values, lambda name: f"--{name}")


def parsed(*argv: str):
    return build_parser().parse_args(["launch", *argv])


# ------------------------------------------------------------------------------ resolve
def test_defaults_run_one_process_directly_for_single(script):
    plan = resolve(str(script))
    assert (str(plan.target), plan.num_processes, plan.num_machines, plan.direct) == (
        "single",
        1,
        1,
        True,
    )
    assert (plan.target_origin, plan.config_file) == ("default for 1 process", None)


def test_several_processes_default_to_ddp_on_a_free_port(script):
    plan = resolve(str(script), flags=flags(num_processes="2", mixed_precision="bf16"))
    assert (str(plan.target), plan.nproc_per_node, plan.direct) == ("ddp+bf16", 2, False)
    assert plan.target_origin == "default for 2 processes with --mixed_precision bf16"
    assert 0 < plan.main_process_port < 65536 and plan.main_process_ip == "127.0.0.1"


def test_flags_then_config_file_then_default_location_then_defaults(script, tmp_path):
    default = write(
        Path.home() / ".cache" / "retarget" / "default_config.yaml",
        "target: fsdp\nnum_processes: 2\nmain_process_port: 1234\n",
    )
    explicit = write(tmp_path / "explicit.yaml", "target: zero2\nnum_processes: 4\n")

    from_default = resolve(str(script))
    assert (str(from_default.target), from_default.num_processes) == ("fsdp", 2)
    assert (from_default.main_process_port, from_default.config_file) == (1234, str(default))

    from_file = resolve(str(script), config_file=explicit)  # the default file is not read
    assert (str(from_file.target), from_file.num_processes) == ("zero2", 4)
    assert from_file.main_process_port != 1234 and from_file.config_file == str(explicit)

    from_flags = resolve(
        str(script), flags=flags(num_processes="2", target="ddp"), config_file=explicit
    )
    assert (str(from_flags.target), from_flags.num_processes) == ("ddp", 2)
    assert from_flags.target_origin == "--target"


def test_mixed_precision_flag_replaces_the_files_precision(script, tmp_path):
    config = write(tmp_path / "c.yaml", "target: fsdp+fp16+ac\nnum_processes: 2\n")
    plan = resolve(str(script), flags=flags(mixed_precision="bf16"), config_file=config)
    assert str(plan.target) == "fsdp+bf16+ac"
    assert plan.target_origin == f"{config}: target with --mixed_precision bf16"


def test_accelerate_config_file_launches_its_target(script, tmp_path):
    config = write(
        tmp_path / "acc.yaml",
        "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\nuse_cpu: true\n",
    )
    plan = resolve(str(script), config_file=config)
    assert (str(plan.target), plan.num_processes) == ("ddp+bf16", 2)
    assert worker_env(plan) == {TARGET_ENV: "ddp+bf16", "CUDA_VISIBLE_DEVICES": ""}


# ------------------------------------------------------------------------------ torchrun
def test_torchrun_arguments_for_one_machine(script):
    plan = resolve(str(script), ["--lr", "3", "-x"], flags=flags(num_processes="2"))
    args = torchrun_args(plan)
    port = str(plan.main_process_port)
    assert args == [
        *("--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0"),
        *("--master_addr", "127.0.0.1", "--master_port", port),
        *("--no_python", sys.executable, "-u", str(WORKER), str(script), "--lr", "3", "-x"),
    ]
    read = torchrun.parse_args(args)  # torchrun's own parser reads them as meant
    assert (read.nproc_per_node, read.nnodes, read.master_port) == ("2", "1", int(port))
    assert read.no_python and read.training_script == sys.executable
    assert read.training_script_args == ["-u", str(WORKER), str(script), "--lr", "3", "-x"]


def test_torchrun_arguments_for_several_machines(script):
    settings = flags(
        num_processes="8", num_machines="2", machine_rank="1", main_process_ip="10.0.0.1"
    )
    args = torchrun_args(resolve(str(script), flags=settings))
    assert args[:10] == [
        *("--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1"),
        *("--master_addr", "10.0.0.1", "--master_port", "29500"),
    ]
    assert args[10:12] == ["--rdzv_conf", "timeout=600,join_timeout=600"]
    c10d = flags(
        num_processes="2", num_machines="2", main_process_ip="h", rdzv_backend="c10d",
        join_timeout="30",
    )  # fmt: skip
    args = torchrun_args(resolve(str(script), flags=c10d))
    assert args[6:12] == [
        *("--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29500"),
        *("--rdzv_conf", "timeout=30,join_timeout=30"),
    ]


def test_worker_env_carries_the_target_and_device_choice(script):
    plan = resolve(str(script), flags=flags(target="fsdp+bf16", num_processes="2", gpu_ids="0,1"))
    assert worker_env(plan) == {TARGET_ENV: "fsdp+bf16", "CUDA_VISIBLE_DEVICES": "0,1"}


# ------------------------------------------------------------------------------ command line
def test_flags_take_dashed_spellings_and_script_arguments_stay_untouched(script):
    args = parsed(
        "--num-processes", "2", "--mixed-precision", "bf16", "--main-process-port", "2950",
        str(script), "--num_processes", "5", "-h", "--config_file", "x",
    )  # fmt: skip
    assert (args.num_processes, args.mixed_precision, args.config_file) == ("2", "bf16", None)
    assert args.script_args == ["--num_processes", "5", "-h", "--config_file", "x"]
    plan = plan_from_args(args)
    assert (plan.num_processes, plan.main_process_port, str(plan.target)) == (2, 2950, "ddp+bf16")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num_processes", "0"], "--num_processes: must be at least 1, got 0"),
        (["--num_processes", "-2"], "--num_processes: must be at least 1, got -2"),
        (["--num_processes", "two"], "--num_processes: expected an integer at least 1, got 'two'"),
        (["--num_processes", "1.5"], "expected an integer at least 1, got '1.5'"),
        (["--mixed_precision", "fp32"], "--mixed_precision: 'fp32' is not one of no, bf16"),
        (["--target", "fsdpp"], "--target: unknown target part 'fsdpp'; did you mean 'fsdp'?"),
        (["--target", "single", "--num_processes", "2"], "'single' has no distribution part"),
        (["--num_machines", "2", "--num_processes", "2"], "set --main_process_ip"),
        (["--config_file", "{tmp}/nope.yaml"], "--config_file {tmp}/nope.yaml: no such file"),
        (["--config_file", "{tmp}/unknown.yaml"], "unknown key 'num_procs'; did you mean"),
        (["--config_file", "{tmp}/target.yaml"], "target.yaml: target: unknown target part"),
        # options no pass realises: refused here, not by every rank after start-up
        (
            ["--target", "fsdp+offload[params=false]", "--num_processes", "2"],
            "(--target) would be refused by every rank: 'offload[params=false]': FSDP2's",
        ),
        (
            ["--config_file", "{tmp}/contradiction.yaml"],
            "contradiction.yaml: target) would be refused by every rank: "
            "'fsdp[cpu_ram_efficient_loading=true,sync_module_states=false]'",
        ),
        (
            ["--config_file", "{tmp}/contradiction.yaml"],
            "set by fsdp_config: fsdp_cpu_ram_efficient_loading, fsdp_config: "
            "fsdp_sync_module_states in {tmp}/contradiction.yaml",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_runs(capsys, script, tmp_path, argv, message):
    write(tmp_path / "unknown.yaml", "num_procs: 2\n")
    write(tmp_path / "target.yaml", "target: ddpp\n")
    write(
        tmp_path / "contradiction.yaml",
        """\
        distributed_type: FSDP
        num_processes: 2
        fsdp_config:
          fsdp_version: 2
          fsdp_cpu_ram_efficient_loading: true
          fsdp_sync_module_states: false
        """,
    )
    argv = [a.format(tmp=tmp_path) for a in argv]
    code = main(["launch", *argv, str(script)])
    err = capsys.readouterr().err
    assert code == 2
    assert message.format(tmp=tmp_path) in err
    assert err.count("\n") == 1 and err.startswith("retarget launch: error: ")
    assert not (tmp_path / "ran").exists()


def test_missing_script_is_one_line_exit_2(capsys, tmp_path):
    assert main(["launch", "--num_processes", "2", str(tmp_path / "nope.py")]) == 2
    missing = tmp_path / "nope.py"
    expected = f"retarget launch: error: script '{missing}' does not exist (or is not a file)\n"
    assert capsys.readouterr().err == expected


# ------------------------------------------------------------------------------ launched_target
def test_launched_target(monkeypatch):
    assert launched_target() is None
    monkeypatch.setenv(TARGET_ENV, "bf16+ddp")
    assert launched_target() == Target.parse("ddp+bf16")
    monkeypatch.setenv(TARGET_ENV, "dpp")
    with pytest.raises(TargetError, match=r"\$RETARGET_TARGET='dpp': unknown target part 'dpp'"):
        launched_target()


# ------------------------------------------------------------------------------ failures
def failure(tmp_path, rank: int, exitcode: int, error: BaseException | None = None, at=None):
    """torch's ProcessFailure for a rank, with launch_worker's error file when `error` is set."""
    error_file = tmp_path / f"error{rank}.json"
    if error is not None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(launch_worker.time, "time_ns", lambda: at)
            launch_worker.record_failure(error, str(error_file))
    return ProcessFailure(
        local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file)
    )


def test_summary_names_the_first_failure_within_the_same_second(tmp_path):
    second = 1_800_000_000 * 10**9
    failures = {
        0: failure(tmp_path, 0, 1, RuntimeError("Connection closed by peer"), second + 900),
        1: failure(tmp_path, 1, 1, ValueError("bad shard"), second + 100),
        2: failure(tmp_path, 2, -signal.SIGTERM),  # stopped by torchrun after the failure
    }
    assert failure_summary(failures) == [
        "rank 1 failed: ValueError: bad shard",
        "rank 0 stopped after it: RuntimeError: Connection closed by peer",
        "rank 2 stopped after it: killed by SIGTERM",
    ]


def test_summary_without_a_recorded_exception(tmp_path):
    failures = {0: failure(tmp_path, 0, -signal.SIGTERM), 1: failure(tmp_path, 1, 3)}
    lines = failure_summary(failures)
    assert lines[0].startswith("rank 1 failed: exited with code 3 without a Python exception")
    assert failure_summary({4: failure(tmp_path, 4, -signal.SIGKILL)}) == [
        "rank 4 failed: killed by SIGKILL"
    ]


def test_summary_message_is_one_bounded_line(tmp_path):
    long = failure(tmp_path, 0, 1, RuntimeError("line one\nline two " + "x" * 500), 1)
    (line,) = failure_summary({0: long})
    assert line.startswith("rank 0 failed: RuntimeError: line one line two xxx")
    assert len(line) == len("rank 0 failed: ") + 300 and line.endswith("...")


# ------------------------------------------------------------------------------ launch_worker
@pytest.mark.distributed
def test_worker_runs_the_script_as_main_and_records_its_exception(tmp_path):
    write(tmp_path / "helper.py", "VALUE = 'from the script directory'\n")
    train = write(
        tmp_path / "train.py",
        """
        import sys
        import helper
        print(__name__, helper.VALUE, sys.argv)
        if sys.argv[1] == "exit":
            sys.exit(int(sys.argv[2]))
        {}["missing key"]
        """,
    )

    def run(*args: str) -> tuple[subprocess.CompletedProcess, Path]:
        error_file = tmp_path / f"error-{'-'.join(args)}.json"
        env = {"TORCHELASTIC_ERROR_FILE": str(error_file), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [sys.executable, str(WORKER), str(train), *args], capture_output=True, text=True,
            env=env, cwd="/", timeout=60,
        )  # fmt: skip
        return done, error_file

    raised, error_file = run("raise", "--flag")
    assert raised.returncode == 1
    assert f"__main__ from the script directory ['{train}', 'raise', '--flag']" in raised.stdout
    assert raised.stderr.startswith(f'Traceback (most recent call last):\n  File "{train}"')
    assert "runpy" not in raised.stderr and "launch_worker" not in raised.stderr
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == "KeyError: 'missing key'"
    assert int(record["extraInfo"]["retarget_time_ns"]) // 10**9 == int(
        record["extraInfo"]["timestamp"]
    )
    exited, error_file = run("exit", "3")
    assert exited.returncode == 3 and json.loads(error_file.read_text())["message"]["message"] == (
        "SystemExit: 3"
    )
    clean, error_file = run("exit", "0")
    assert clean.returncode == 0 and not error_file.exists()


@pytest.mark.distributed
def test_worker_destroys_the_process_group_a_finished_script_left(tmp_path):
    train = write(
        tmp_path / "train.py",
        """
        import atexit
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        atexit.register(lambda: print("at exit, initialised:", dist.is_initialized()))
        """,
    )
    done = subprocess.run(
        [sys.executable, str(WORKER), str(train)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "at exit, initialised: False"


# ------------------------------------------------------------------------------ real launches
def retarget_launch(*argv: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "retarget", "launch", *argv],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout,
    )  # fmt: skip


def seen(stdout: str) -> list[dict]:
    rows = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("SEEN ")]
    return sorted(rows, key=lambda row: row["rank"])


@pytest.mark.distributed
def test_two_processes_see_their_ranks_the_target_and_their_arguments(tmp_path):
    script = SCRIPTS / "print_rank.py"
    done = retarget_launch(
        "--num_processes", "2", "--mixed_precision", "bf16", str(script), "--lr", "3",
        "--num_processes", "7", home=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = seen(done.stdout)
    assert [(row["rank"], row["world"], row["rank_sum"]) for row in rows] == [(0, 2, 1), (1, 2, 1)]
    for row in rows:
        assert row["target"] == "ddp+bf16" and row["torchrun"]
        assert row["argv"] == ["--lr", "3", "--num_processes", "7"]
        assert (row["name"], row["path0"]) == ("__main__", str(SCRIPTS))
    assert "retarget launch: " in done.stderr and "on 2 processes" in done.stderr


@pytest.mark.distributed
def test_one_process_runs_directly_with_the_same_contract_and_exit_code(tmp_path):
    script = SCRIPTS / "print_rank.py"
    done = retarget_launch("--target", "bf16", str(script), "--exit", "3", home=tmp_path)
    assert done.returncode == 3, done.stderr
    (row,) = seen(done.stdout)
    assert (row["rank"], row["world"], row["target"], row["torchrun"]) == (0, 1, "bf16", False)
    assert row["argv"] == ["--exit", "3"] and row["path0"] == str(SCRIPTS)
    assert "(1 machine, directly)" in done.stderr


@pytest.mark.distributed
def test_a_failing_rank_stops_the_other_and_is_named(tmp_path):
    started = time.monotonic()
    done = retarget_launch("--num_processes", "2", str(SCRIPTS / "fail_rank1.py"), home=tmp_path)
    elapsed = time.monotonic() - started
    assert elapsed < 60
    assert done.returncode == 1
    assert "rank 0 finished" not in done.stdout
    lines = done.stderr.splitlines()
    assert lines[-2:] == [
        "retarget launch: rank 1 failed: ValueError: rank 1 cannot read shard 7",
        "retarget launch: rank 0 stopped after it: killed by SIGTERM",
    ]
    assert "[rank1]: ValueError: rank 1 cannot read shard 7" in done.stderr  # its traceback


# ------------------------------------------------------------------------------ MNIST tutorial
def changed_lines(before: list[str], after: list[str]) -> int:
    """Lines that differ: a replaced block counts its longer side; deletions, insertions count."""
    matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
    return sum(
        max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"
    )


def test_mnist_tutorial_differs_from_accelerates_in_at_most_4_lines():
    accelerate = (SCRIPTS / "mnist_tutorial_accelerate.py").read_text().splitlines()
    ours = (SCRIPTS / "mnist_tutorial.py").read_text().splitlines()
    assert changed_lines(accelerate, ours) <= 4
    assert changed_lines(accelerate, ours[:-1]) > changed_lines(accelerate, ours)  # it counts


@pytest.mark.distributed
def test_mnist_tutorial_trains_under_retarget_launch_on_2_processes(tmp_path):
    done = retarget_launch(
        "--num_processes", "2", str(SCRIPTS / "mnist_tutorial.py"), home=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stderr
    printed = re.findall(r"epoch (\d): accuracy ([0-9.]+) on (\d+) images", done.stdout)
    assert [epoch for epoch, _, _ in printed] == ["0", "1"]  # the main process prints, once
    assert all(total == "250" for _, _, total in printed)  # gather_for_metrics: no padding
    assert float(printed[-1][1]) > 0.4  # 10 classes: chance is 0.1 (measured: 0.70)
