"""Launch settings files (retarget/launch/config.py): reading ours and Accelerate's,
the rules between settings, where the file in effect is, precision folding and merging."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from retarget.launch.config import (
    CONFIG_ENV,
    LaunchConfig,
    LaunchError,
    config_in_effect,
    merged,
    read_launch_config,
    read_settings,
    write_launch_config,
)
from retarget.targets.grammar import Target
from retarget.targets.precisions import precision_of, with_precision


@pytest.fixture(autouse=True)
def _isolated_home(monkeypatch, tmp_path):
    """No real ~/.cache/retarget or $RETARGET_CONFIG leaks into a test."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CONFIG_ENV, raising=False)


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ our format
def test_reads_every_key_of_our_format(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        """
        target: fsdp[reshard=false]+ac
        num_processes: 4
        num_machines: 2
        machine_rank: 1
        main_process_ip: 10.0.0.1
        main_process_port: "29501"
        mixed_precision: bf16
        use_cpu: false
        gpu_ids: 0, 1
        rdzv_backend: C10D
        """,
    )
    config = read_launch_config(path)
    assert config.settings() == {
        "target": Target.parse("fsdp[reshard=false]+ac"),
        "num_processes": 4,
        "num_machines": 2,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 29501,
        "mixed_precision": "bf16",
        "use_cpu": False,
        "gpu_ids": "0,1",
        "rdzv_backend": "c10d",
    }
    assert config.origin("num_processes") == f"{path}: num_processes"


def test_bare_yaml_no_is_mixed_precision_no_and_an_empty_file_sets_nothing(tmp_path):
    assert read_launch_config(write(tmp_path / "a.yaml", "mixed_precision: no\n")).settings() == {
        "mixed_precision": "no"
    }
    assert read_launch_config(write(tmp_path / "b.yaml", "")).settings() == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_process: 2", "unknown key 'num_process'; did you mean 'num_processes'?"),
        ("target: fsdpp", "target: unknown target part 'fsdpp'; did you mean 'fsdp'?"),
        ("num_processes: 0", "num_processes: must be at least 1, got 0"),
        ("num_processes: two", "num_processes: expected an integer at least 1, got 'two'"),
        ("num_processes: true", "num_processes: expected an integer at least 1, got True"),
        ("main_process_port: 70000", "main_process_port: must be between 1 and 65535"),
        ("mixed_precision: fp32", "'fp32' is not one of no, bf16, fp16, fp8"),
        ("use_cpu: maybe", "use_cpu: expected true or false, got 'maybe'"),
        ("gpu_ids: first", "gpu_ids: expected 'all' or indices like '0,1', got 'first'"),
        ("rdzv_backend: etcd", "rdzv_backend: 'etcd' is not one of static, c10d"),
        ("num_machines: 2\nmachine_rank: 2", "machine ranks run from 0 to 1"),
        ("num_machines: 2\nnum_processes: 3", "num_processes is 3, not a multiple of"),
        ("target: single\nnum_processes: 2", "'single' has no distribution part"),
        ("target: bf16\nnum_processes: 2", "use e.g. 'ddp+bf16' or fsdp"),
        ("target: ddp+fp16\nmixed_precision: bf16", "says fp16 but"),
        ("use_cpu: true\ngpu_ids: '0'", "use_cpu hides the GPUs"),
        ("- a list", "expected a mapping of settings"),
        ("target: [", "not valid YAML"),
    ],
)
def test_bad_files_are_refused_naming_file_and_key(tmp_path, text, message):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(LaunchError) as caught:
        read_launch_config(path)
    assert message in str(caught.value)
    assert str(caught.value).startswith(str(path))
    assert "\n" not in str(caught.value)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(LaunchError, match="no such config file"):
        read_launch_config(tmp_path / "nope.yaml")


def test_tp_alone_is_distributed_so_several_processes_are_fine(tmp_path):
    config = read_launch_config(write(tmp_path / "tp.yaml", "target: tp\nnum_processes: 2\n"))
    assert config.num_processes == 2


def test_write_then_read_gives_the_same_settings(tmp_path):
    config = LaunchConfig(
        target=Target.parse("fsdp+ac"), num_processes=2, mixed_precision="no", use_cpu=True
    )
    path = write_launch_config(config, tmp_path / "sub" / "c.yaml")
    assert path.read_text().startswith("# retarget launch settings")
    assert "mixed_precision: 'no'" in path.read_text()  # quoted: a bare no would read as false
    assert read_launch_config(path) == config


# ------------------------------------------------------------------------------ Accelerate
def test_accelerate_config_is_read_through_accelerate_config(tmp_path):
    path = write(
        tmp_path / "acc.yaml",
        """
        compute_environment: LOCAL_MACHINE
        distributed_type: MULTI_CPU
        mixed_precision: bf16
        num_machines: 1
        num_processes: 2
        machine_rank: 0
        main_process_ip: null
        main_process_port: null
        gpu_ids: all
        rdzv_backend: static
        same_network: true
        use_cpu: true
        """,
    )
    config = read_launch_config(path)
    assert config.target == Target.parse("ddp+bf16")
    assert (config.num_processes, config.num_machines, config.use_cpu) == (2, 1, True)
    assert config.mixed_precision is None and config.gpu_ids is None  # folded; all = unset


def test_accelerate_config_errors_keep_their_message(tmp_path):
    path = write(tmp_path / "acc.yaml", "distributed_type: MULTI_CPU\nfsdp_confg: {}\n")
    with pytest.raises(LaunchError, match="fsdp_confg: unknown key; did you mean 'fsdp_config'"):
        read_launch_config(path)


def test_accelerate_gradient_accumulation_is_refused_not_dropped(tmp_path):
    text = "distributed_type: MULTI_CPU\nnum_processes: 2\ngradient_accumulation_steps: 4\n"
    with pytest.raises(LaunchError, match="accumulate 4 micro-batches in the script"):
        read_launch_config(write(tmp_path / "acc.yaml", text))


def test_accelerate_single_process_type_with_several_processes_is_refused(tmp_path):
    with pytest.raises(LaunchError, match="distributed_type NO runs one process"):
        read_launch_config(write(tmp_path / "a.yaml", "distributed_type: 'NO'\nnum_processes: 2"))


# ------------------------------------------------------------------------------ where
def test_no_config_anywhere_is_none():
    assert config_in_effect() is None


def test_default_location_then_environment_then_explicit(tmp_path, monkeypatch):
    default = Path.home() / ".cache" / "retarget" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    write(default, "num_processes: 2\n")
    assert config_in_effect() == default
    named = write(tmp_path / "named.yaml", "num_processes: 3\n")
    monkeypatch.setenv(CONFIG_ENV, str(named))
    assert config_in_effect() == named
    explicit = write(tmp_path / "explicit.yaml", "num_processes: 4\n")
    assert config_in_effect(explicit) == explicit


def test_named_files_must_exist(tmp_path, monkeypatch):
    with pytest.raises(LaunchError, match=r"--config_file .*nope.yaml: no such file"):
        config_in_effect(tmp_path / "nope.yaml")
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "gone.yaml"))
    with pytest.raises(LaunchError, match=r"\$RETARGET_CONFIG names .*gone.yaml, which does not"):
        config_in_effect()


# ------------------------------------------------------------------------------ precision
@pytest.mark.parametrize(
    ("target", "mixed", "expected"),
    [
        ("fsdp+fp16", "bf16", "fsdp+bf16"),
        ("ddp", "fp8", "ddp+bf16+fp8"),
        ("ddp+bf16+fp8[backend=te]", "fp8", "ddp+bf16+fp8[backend=te]"),
        ("fp8", "fp8", "fp8"),  # already states fp8: kept as written
        ("ddp+bf16[keep_fp32=softmax]", "bf16", "ddp+bf16[keep_fp32=softmax]"),
        ("ddp+bf16+ac", "no", "ddp+ac"),
        ("bf16", "no", "single"),
    ],
)
def test_with_precision(target, mixed, expected):
    assert str(with_precision(Target.parse(target), mixed)) == expected


def test_precision_of():
    assert [precision_of(Target.parse(s)) for s in ("ddp", "bf16", "fp16", "fp8", "bf16+fp8")] == [
        None,
        "bf16",
        "fp16",
        "fp8",
        "fp8",
    ]


def flags(**values) -> LaunchConfig:
    return read_settings(values, lambda name: f"--{name}")


def from_file(tmp_path, text) -> LaunchConfig:
    return read_launch_config(write(tmp_path / "f.yaml", text))


def test_merged_takes_each_field_from_the_first_layer_that_sets_it(tmp_path):
    result = merged(
        [flags(num_processes="2"), from_file(tmp_path, "num_processes: 4\ntarget: fsdp\n")]
    )
    assert (result.num_processes, str(result.target)) == (2, "fsdp")
    assert result.origin("num_processes") == "--num_processes"
    assert result.origin("target").endswith("f.yaml: target")


@pytest.mark.parametrize(
    ("flag_values", "file_text", "expected"),
    [
        ({"mixed_precision": "bf16"}, "target: fsdp+fp16", "fsdp+bf16"),  # flag beats file
        ({"target": "ddp+fp16"}, "mixed_precision: bf16", "ddp+fp16"),  # a flag's target too
        ({"target": "ddp"}, "mixed_precision: bf16", "ddp+bf16"),  # ddp states no precision
        ({"target": "ddp"}, "target: fsdp+bf16", "ddp"),  # a target is taken whole
        ({}, "target: zero2\nmixed_precision: fp8", "zero2+bf16+fp8"),
    ],
)
def test_precision_comes_from_the_first_layer_that_states_one(
    tmp_path, flag_values, file_text, expected
):
    result = merged([flags(**flag_values), from_file(tmp_path, file_text)])
    assert str(result.target) == expected
    assert result.mixed_precision is None  # folded into the target


def test_merged_keeps_mixed_precision_when_no_layer_names_a_target(tmp_path):
    result = merged([flags(mixed_precision="fp16"), LaunchConfig()])
    assert (result.target, result.mixed_precision) == (None, "fp16")
    assert result.origin("mixed_precision") == "--mixed_precision"
