"""Any YAML a user can write is read or refused with a ConfigError naming the file: never a
traceback from inside the readers (hypothesis writes the files: our launch format, Accelerate's,
its sections, unknown keys, wrong types, text that is not YAML)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retarget import ConfigError
from retarget.compat.accelerate.config_yaml import read_accelerate_config, target_from_yaml
from retarget.launch.config import LaunchError, read_launch_config
from retarget.targets.grammar import TargetError

OURS = (
    "target", "num_processes", "num_machines", "machine_rank", "main_process_ip",
    "main_process_port", "mixed_precision", "use_cpu", "gpu_ids", "rdzv_backend", "max_restarts",
)  # fmt: skip
ACCELERATE = (
    "compute_environment", "distributed_type", "mixed_precision", "downcast_bf16", "num_processes",
    "num_machines", "machine_rank", "use_cpu", "main_process_ip", "main_process_port",
    "gradient_accumulation_steps", "gpu_ids", "rdzv_backend", "same_network", "debug",
    "dynamo_backend", "main_training_function", "tpu_name",
)  # fmt: skip
SECTIONS = {
    "fsdp_config": (
        "fsdp_version", "fsdp_sharding_strategy", "fsdp_offload_params",
        "fsdp_reshard_after_forward",
        "fsdp_activation_checkpointing", "fsdp_auto_wrap_policy", "fsdp_state_dict_type",
        "fsdp_cpu_ram_efficient_loading", "fsdp_transformer_layer_cls_to_wrap",
    ),
    "deepspeed_config": ("zero_stage", "offload_optimizer_device", "offload_param_device"),
    "fp8_config": ("backend", "fp8_format", "amax_history_len", "use_autocast_during_eval"),
    "dynamo_config": ("dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph"),
}  # fmt: skip
WORDS = (
    "NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED", "XLA", "LOCAL_MACHINE", "bf16", "fp16",
    "fp8", "no", "ddp", "fsdp+bf16", "hsdp", "single", "FULL_SHARD", "SHARD_GRAD_OP", "TE",
    "MSAMP", "AO", "HYBRID", "E4M3", "INDUCTOR", "all", "0,1", "static", "c10d", "127.0.0.1",
)  # fmt: skip

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=True),
    st.sampled_from(WORDS), st.text(max_size=12),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
keys = st.sampled_from(OURS + ACCELERATE) | st.text(max_size=10)


@st.composite
def documents(draw):
    """A mapping as users write them: mostly known keys with plausible or wrong values."""
    doc = draw(st.dictionaries(keys, values, max_size=6))
    if draw(st.booleans()):
        doc["distributed_type"] = draw(st.sampled_from(WORDS) | values)
    for section, names in SECTIONS.items():
        if draw(st.integers(0, 3)) == 0:
            doc[section] = draw(
                st.dictionaries(st.sampled_from(names) | st.text(max_size=6), values, max_size=4)
                | values
            )
    return doc


def _check(text: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "config.yaml")
        path.write_text(text)
        for reader in (read_launch_config, read_accelerate_config, target_from_yaml):
            try:
                reader(path)
            except ConfigError as error:
                message = str(error)
                assert message.startswith(str(path)), message
                assert "Traceback" not in message


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(documents())
def test_any_mapping_is_read_or_refused_with_a_config_error(doc):
    _check(yaml.safe_dump(doc, allow_unicode=True))


@FUZZ
@given(
    st.text(max_size=60)
    | st.lists(st.sampled_from(["a: [", "- x", ": :", "b: {c", "\t", "'", "target: 1"])).map(
        "\n".join
    )
)
def test_any_text_is_read_or_refused_with_a_config_error(text):
    _check(text)


def test_config_error_is_what_every_reader_raises():
    assert issubclass(LaunchError, ConfigError) and issubclass(TargetError, ConfigError)
    assert issubclass(ConfigError, ValueError)  # code catching ValueError keeps working
