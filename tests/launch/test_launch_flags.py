"""`retarget launch`'s Accelerate flags (retarget/launch/accelerate_flags.py): every flag of
Accelerate's own launch parser is accepted or refused by name; each mapping onto the target,
torchrun and the script's environment; and real launches with them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.run as torchrun

from retarget import Accelerator
from retarget.cli.main import build_parser, main
from retarget.core.world import ACCUMULATION_ENV, TARGET_ENV
from retarget.launch.accelerate_flags import REFUSED
from retarget.launch.command_line import plan_from_args
from retarget.launch.config import CONFIG_ENV, LaunchError
from retarget.launch.launcher import WORKER, rank_command, torchrun_args, worker_env
from tests.paths import REPO

SCRIPTS = REPO / "tests" / "scripts"


@pytest.fixture(autouse=True)
def _isolated_home(monkeypatch, tmp_path):
    """No real ~/.cache/retarget, $RETARGET_CONFIG or $RETARGET_TARGET leaks into a test."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in (CONFIG_ENV, TARGET_ENV, ACCUMULATION_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n")
    return path


def plan(*argv: str, script: Path):
    return plan_from_args(build_parser().parse_args(["launch", *argv, str(script)]))


def underscored(option: str) -> str:
    return option if not option.startswith("--") else "--" + option[2:].replace("-", "_")


# ------------------------------------------------------------------------------ parity
def _value_for(action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    if action.default not in (None, "", argparse.SUPPRESS) and not isinstance(
        action.default, tuple
    ):
        return [str(action.default)]
    return ["1"]


def test_every_accelerate_launch_flag_is_accepted_or_refused_by_name(script):
    launch = pytest.importorskip("accelerate.commands.launch")
    options = [a for a in launch.launch_command_parser()._actions if a.option_strings]
    options = [a for a in options if a.dest != "help"]
    assert len(options) > 100  # the parser of Accelerate 1.15 has 120 flags
    outcomes = {}
    for action in options:
        for option in action.option_strings:
            argv = ["launch", option, *_value_for(action), str(script)]
            try:
                args = build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"{option}: retarget launch's parser does not know it")
            assert args.script == str(script), f"{option} took the script as its value"
            try:
                plan_from_args(args)
                outcomes[option] = "accepted"
            except LaunchError as error:
                names = {underscored(o) for o in action.option_strings} | {option}
                assert any(name in str(error) for name in names), (option, str(error))
                outcomes[option] = "refused"
    assert outcomes["--multi_gpu"] == outcomes["--use_fsdp"] == "accepted"
    assert outcomes["--tpu"] == outcomes["--use_megatron_lm"] == "refused"


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--tpu"], "torch_xla"),
        (["--tpu_use_sudo"], "torch_xla"),
        (["--use_megatron_lm"], "Megatron-LM"),
        (["--megatron_lm_tp_degree", "2"], "Megatron-LM"),
        (["--mpirun_hostfile", "hosts"], "MPI"),
        (["--aws_access_key_id", "key"], "SageMaker"),
        (["--ipex"], "Intel Extension"),
        (["--use_parallelism_config", "--parallelism_config_cp_backend", "x"], "sizes of a"),
        (["--use_deepspeed", "--deepspeed_config_file", "ds.json"], "JSON files are not read"),
        (["--use_deepspeed", "--deepspeed_hostfile", "hosts"], "hostfiles"),
        (["--use_deepspeed", "--deepspeed_multinode_launcher", "pdsh"], "torchrun"),
        (["--use_fsdp", "--fsdp_auto_wrap_policy", "NO_WRAP"], "its own unit"),
    ],
)
def test_flags_that_cannot_be_honoured_are_refused_by_name_exit_2(capsys, script, argv, reason):
    assert main(["launch", *argv, str(script)]) == 2
    err = capsys.readouterr().err
    flag = [a for a in argv if a.startswith("--")][-1]
    assert f"{flag}" in err and reason in err and "cannot be honoured" in err
    assert "unrecognized arguments" not in err
    assert not script.with_name("ran").exists()


def test_refused_table_names_a_reason_for_each_flag():
    assert all(reason for _, reason in REFUSED.values())
    assert {"tpu", "use_megatron_lm", "mpirun_hostfile", "ipex"} <= set(REFUSED)


# ------------------------------------------------------------------------------ the target
@pytest.mark.parametrize(
    "argv, target",
    [
        (["--multi_gpu", "--num_processes", "2", "--mixed_precision", "bf16"], "ddp+bf16"),
        (["--multi_gpu", "--mixed_precision", "fp16"], "ddp+fp16"),
        (["--use_fsdp"], "fsdp"),
        (
            ["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--fsdp_offload_params",
             "true", "--num_processes", "2"],
            "zero2+offload",
        ),
        (
            ["--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "false",
             "--fsdp_activation_checkpointing", "true", "--mixed_precision", "bf16"],
            "zero2+bf16+ac",
        ),
        (["--use_fsdp", "--fsdp_state_dict_type", "FULL_STATE_DICT"], "fsdp[state_dict=full]"),
        (["--use_deepspeed"], "zero2"),  # DeepSpeedPlugin's default stage
        (["--use_deepspeed", "--zero_stage", "1"], "zero1"),
        (
            ["--use_deepspeed", "--zero_stage", "3", "--offload_param_device", "cpu",
             "--offload_optimizer_device", "cpu"],
            "zero3+offload",
        ),
        (
            ["--multi_gpu", "--mixed_precision", "fp8", "--fp8_backend", "TE", "--fp8_margin", "1",
             "--fp8_format", "E4M3", "--fp8_override_linear_precision", "false,false,true"],
            "ddp+bf16+fp8[amax_history=1024,backend=te,format=e4m3,margin=1,"
            "override_linear_precision=false|false|true]",
        ),
        (
            ["--use_parallelism_config", "--parallelism_config_tp_size", "2",
             "--parallelism_config_dp_shard_size", "2", "--mixed_precision", "bf16"],
            "fsdp+tp[size=2]+bf16",
        ),
        (["--use_parallelism_config", "--parallelism_config_tp_size", "4"], "tp[size=4]"),
        (
            ["--use_parallelism_config", "--parallelism_config_cp_size", "2",
             "--parallelism_config_dp_shard_size", "2",
             "--parallelism_config_cp_comm_strategy", "allgather"],
            "fsdp+cp[attention=allgather,size=2]",
        ),
        (["--use_parallelism_config", "--parallelism_config_sp_size", "2"],
         "fsdp+cp[attention=ulysses,size=2]"),
        (  # as Accelerate asks for it: with --use_fsdp, whose flags keep their meaning
            ["--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "false",
             "--fsdp_activation_checkpointing", "true", "--use_parallelism_config",
             "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"],
            "zero2+tp[size=2]+ac",
        ),
        (  # precision flags alone change the precision of the target in effect
            ["--target", "fsdp", "--mixed_precision", "fp8", "--fp8_backend", "AO"],
            "fsdp+bf16+fp8[backend=torchao,scaling=current]",
        ),
    ],
)  # fmt: skip
def test_distribution_and_precision_flags_become_the_target(script, argv, target):
    decided = plan(*argv, script=script)
    assert str(decided.target) == target
    assert argv[0] in decided.target_origin


def test_flags_mean_what_the_same_yaml_keys_mean(script, tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\n"
        "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_min_num_params: 1000\n"
    )
    from_file = plan("--config_file", str(config), script=script)
    from_flags = plan(
        "--use_fsdp", "--fsdp_sharding_strategy", "HYBRID_SHARD", "--fsdp_min_num_params",
        "1000", "--mixed_precision", "bf16", "--num_processes", "2", script=script,
    )  # fmt: skip
    assert from_flags.target == from_file.target


def test_distribution_flags_replace_the_files_target_and_keep_its_precision(script, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("target: fsdp\nmixed_precision: bf16\nnum_processes: 2\n")
    on = ("--config_file", str(config))
    assert str(plan(*on, "--multi_gpu", script=script).target) == "ddp+bf16"  # as Accelerate
    whole = tmp_path / "whole.yaml"  # a target is taken whole, as `--target ddp` over it
    whole.write_text("target: fsdp+bf16\n")
    assert str(plan("--config_file", str(whole), "--multi_gpu", script=script).target) == "ddp"
    assert str(plan(*on, "--multi_gpu", "--mixed_precision", "no", script=script).target) == "ddp"
    fp8 = plan(*on, "--use_fsdp", "--mixed_precision", "fp8", "--fp8_margin", "2", script=script)
    assert str(fp8.target) == "fsdp+bf16+fp8[margin=2]"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fsdp_offload_params", "true"], "--fsdp_offload_params applies only with --use_fsdp"),
        (["--zero_stage", "2"], "--zero_stage applies only with --use_deepspeed"),
        (["--multi_gpu", "--use_fsdp"], "--multi_gpu and --use_fsdp both given"),
        (["--multi_gpu", "--target", "ddp"], "--target and --multi_gpu both say the target"),
        (["--fp8_backend", "TE"], "--fp8_backend: is set but mixed_precision is no"),
        (["--use_deepspeed", "--zero_stage", "5"], "--zero_stage: 5 is not one of 0, 1, 2, 3"),
        (["--use_fsdp", "--fsdp_min_num_params", "many"], "--fsdp_min_num_params: expected an"),
        (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps is 0"),
        (["-m", "--no_python"], "-m/--module and --no_python both given"),
        (
            ["--multi_gpu", "--use_parallelism_config", "--parallelism_config_tp_size", "2"],
            "--parallelism_config_tp_size with --multi_gpu",
        ),
        (
            ["--use_parallelism_config", "--parallelism_config_tp_size", "2",
             "--parallelism_config_dp_replicate_size", "2"],
            "--use_parallelism_config --parallelism_config_dp_replicate_size "
            "--parallelism_config_tp_size: dp_replicate_size=2 with tp_size=2",
        ),
    ],
)  # fmt: skip
def test_bad_flag_combinations_name_the_flag(script, argv, message):
    with pytest.raises(LaunchError, match="^" + message.replace("[", r"\[")):
        plan(*argv, script=script)


# ------------------------------------------------------------------------------ torchrun, env
def test_torchrun_flags_pass_through(script, tmp_path):
    decided = plan(
        "--num_processes", "2", "--tee", "3", "--log_dir", str(tmp_path), "--role", "trainer",
        "--monitor_interval", "0.5", "--rdzv_conf", "read_timeout=90", script=script,
    )  # fmt: skip
    parsed = torchrun.parse_args(torchrun_args(decided))
    assert (parsed.tee, parsed.log_dir, parsed.role) == ("3", str(tmp_path), "trainer")
    assert (parsed.monitor_interval, parsed.rdzv_conf) == (0.5, "read_timeout=90")


def test_rdzv_conf_joins_the_join_timeout_on_several_machines(script):
    decided = plan(
        "--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
        "--main_process_ip", "10.0.0.1", "--rdzv_conf", "timeout=5", script=script,
    )  # fmt: skip
    parsed = torchrun.parse_args(torchrun_args(decided))
    assert parsed.rdzv_conf == "timeout=600,join_timeout=600,timeout=5"  # the user's last: wins


def test_how_a_rank_starts_for_a_script_a_module_and_a_program(script):
    assert rank_command(plan(script=script))[2:4] == [str(WORKER), str(script)]
    module = plan_from_args(build_parser().parse_args(["launch", "-m", "pkg.train", "--lr", "1"]))
    assert rank_command(module) == [
        sys.executable,
        "-u",
        str(WORKER),
        "-m",
        "pkg.train",
        "--lr",
        "1",
    ]  # noqa: E501
    program = plan_from_args(build_parser().parse_args(["launch", "--no_python", "echo", "hi"]))
    assert rank_command(program) == ["echo", "hi"]


def test_script_environment_as_accelerate_exports_it(script):
    decided = plan(
        "--gradient_accumulation_steps", "4", "--num_cpu_threads_per_process", "3", "--debug",
        script=script,
    )  # fmt: skip
    env = worker_env(decided)
    assert env[ACCUMULATION_ENV] == "4" and env["OMP_NUM_THREADS"] == "3"
    assert env["ACCELERATE_DEBUG_MODE"] == "true"
    assert ACCUMULATION_ENV not in worker_env(plan(script=script))


def test_accelerator_reads_the_accumulation_steps_unless_given_in_code(monkeypatch):
    monkeypatch.setenv(ACCUMULATION_ENV, "3")
    assert Accelerator().gradient_accumulation_steps == 3
    assert Accelerator(gradient_accumulation_steps=5).gradient_accumulation_steps == 5
    monkeypatch.setenv(ACCUMULATION_ENV, "three")
    with pytest.raises(ValueError, match=r"\$ACCELERATE_GRADIENT_ACCUMULATION_STEPS='three'"):
        Accelerator()


def test_quiet_leaves_out_the_launch_line(capsys, script):
    assert main(["launch", "-q", str(script)]) == 0
    assert "retarget launch:" not in capsys.readouterr().err
    assert script.with_name("ran").exists()
    assert main(["launch", str(script)]) == 0
    assert "retarget launch:" in capsys.readouterr().err


# ------------------------------------------------------------------------------ real launches
def retarget_launch(*argv: str, home: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "retarget", "launch", *argv],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=180,
    )  # fmt: skip


def seen(stdout: str) -> list[dict]:
    rows = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("SEEN ")]
    return sorted(rows, key=lambda row: row["rank"])


@pytest.mark.distributed
def test_multi_gpu_bf16_and_accumulation_reach_the_script_on_2_processes(tmp_path):
    done = retarget_launch(
        "--multi_gpu", "--num_processes", "2", "--mixed_precision", "bf16",
        "--gradient_accumulation_steps", "2", str(SCRIPTS / "accumulation_seen.py"),
        home=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = seen(done.stdout)
    assert [(row["rank"], row["world"]) for row in rows] == [(0, 2), (1, 2)]
    for row in rows:
        assert (row["target"], row["mixed_precision"]) == ("ddp+bf16", "bf16")
        assert (row["accumulation"], row["env"]) == (2, "2")
    assert "launched target ddp+bf16 (--multi_gpu --mixed_precision;" in done.stderr


@pytest.mark.distributed
def test_module_and_program_run_on_2_processes(tmp_path):
    done = retarget_launch(
        "--num_processes", "2", "-m", "tests.scripts.print_rank", "--lr", "3", home=tmp_path
    )
    assert done.returncode == 0, done.stderr
    rows = seen(done.stdout)
    assert [(row["rank"], row["world"], row["rank_sum"]) for row in rows] == [(0, 2, 1), (1, 2, 1)]
    assert all(row["name"] == "__main__" and row["argv"] == ["--lr", "3"] for row in rows)
    assert all(row["path0"] == str(REPO) for row in rows)  # python -m: the cwd first
    done = retarget_launch("-m", "tests.scripts.print_rank", home=tmp_path)  # run directly
    assert done.returncode == 0, done.stderr
    (row,) = seen(done.stdout)
    assert (row["world"], row["name"], row["torchrun"]) == (1, "__main__", False)
    done = retarget_launch(
        "--num_processes", "2", "--no_python", "sh", "-c", "echo RANK=$RANK", home=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert sorted(line for line in done.stdout.splitlines() if "RANK=" in line) == [
        "RANK=0",
        "RANK=1",
    ]
