"""Accelerate config files read as a target and launch settings (compat/accelerate/config_yaml.py,
compat/accelerate/config_sections.py, compat/accelerate/config_keys.py)."""

from __future__ import annotations

import textwrap

import pytest

import retarget
from retarget.compat.accelerate.config_yaml import (
    AccelerateConfig,
    read_accelerate_config,
    target_from_yaml,
)
from retarget.targets.grammar import Target, TargetError, parse_target


def write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_multi_gpu_bf16(tmp_path):
    path = write(
        tmp_path,
        """
        compute_environment: LOCAL_MACHINE
        debug: false
        distributed_type: MULTI_GPU
        downcast_bf16: 'no'
        enable_cpu_affinity: false
        gpu_ids: all
        machine_rank: 1
        main_process_ip: 10.0.0.1
        main_process_port: 29500
        main_training_function: main
        mixed_precision: bf16
        num_machines: 2
        num_processes: 16
        rdzv_backend: c10d
        same_network: false
        tpu_env: []
        tpu_use_cluster: false
        tpu_use_sudo: false
        use_cpu: false
        """,
    )
    config = read_accelerate_config(path)
    assert config == AccelerateConfig(
        target=parse_target("ddp+bf16"),
        num_processes=16,
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=29500,
        gradient_accumulation_steps=1,
        use_cpu=False,
        source=path,
        gpu_ids="all",
        rdzv_backend="c10d",
    )
    assert target_from_yaml(path) == config.target


def test_fsdp_full_shard_with_offload_and_checkpointing(tmp_path):
    path = write(
        tmp_path,
        """
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        downcast_bf16: 'no'
        fsdp_config:
          fsdp_activation_checkpointing: true
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
          fsdp_backward_prefetch: BACKWARD_PRE
          fsdp_cpu_ram_efficient_loading: true
          fsdp_forward_prefetch: false
          fsdp_offload_params: true
          fsdp_sharding_strategy: FULL_SHARD
          fsdp_state_dict_type: FULL_STATE_DICT
          fsdp_sync_module_states: true
          fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
          fsdp_use_orig_params: true
        machine_rank: 0
        mixed_precision: bf16
        num_machines: 1
        num_processes: 8
        use_cpu: false
        """,
    )
    config = read_accelerate_config(path)
    assert (
        str(config.target) == "fsdp[cpu_ram_efficient_loading=true,state_dict=full]+bf16+ac+offload"
    )
    assert (config.num_processes, config.num_machines, config.machine_rank) == (8, 1, 0)


def test_fsdp2_without_reshard_after_forward_is_zero2(tmp_path):
    path = write(
        tmp_path,
        """
        distributed_type: FSDP
        fsdp_config:
          fsdp_version: 2
          fsdp_reshard_after_forward: false
          fsdp_auto_wrap_policy: SIZE_BASED_WRAP
          fsdp_min_num_params: 100000000
          fsdp_state_dict_type: SHARDED_STATE_DICT
          fsdp_cpu_ram_efficient_loading: false
        mixed_precision: 'no'
        num_processes: 4
        """,
    )
    assert str(target_from_yaml(path)) == "zero2[min_params=100000000]"


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("1", "fsdp"),
        ("SHARD_GRAD_OP", "zero2"),
        ("3", "ddp"),
        ("HYBRID_SHARD", "hsdp"),
        ("5", "hsdp[reshard=false]"),
        ("hybrid_shard_zero2", "hsdp[reshard=false]"),
    ],
)
def test_fsdp_sharding_strategies(tmp_path, strategy, expected):
    text = f"distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: {strategy}\n"
    assert str(target_from_yaml(write(tmp_path, text))) == expected


def test_deepspeed_zero2_with_optimizer_offload(tmp_path):
    path = write(
        tmp_path,
        """
        compute_environment: LOCAL_MACHINE
        deepspeed_config:
          gradient_accumulation_steps: 4
          offload_optimizer_device: cpu
          offload_param_device: none
          zero3_init_flag: false
          zero_stage: 2
        distributed_type: DEEPSPEED
        mixed_precision: fp16
        num_machines: 1
        num_processes: 4
        """,
    )
    config = read_accelerate_config(path)
    assert str(config.target) == "zero2+fp16+offload[params=false]"
    assert config.gradient_accumulation_steps == 4
    assert config.num_processes == 4


@pytest.mark.parametrize(("stage", "expected"), [(0, "ddp"), (1, "zero1"), (3, "zero3")])
def test_deepspeed_stages(tmp_path, stage, expected):
    text = f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: {stage}\n"
    assert str(target_from_yaml(write(tmp_path, text))) == expected


def test_fp8_with_transformer_engine_recipe(tmp_path):
    path = write(
        tmp_path,
        """
        distributed_type: MULTI_GPU
        mixed_precision: fp8
        num_processes: 2
        fp8_config:
          backend: TE
          fp8_format: E4M3
          amax_history_length: 512
          amax_compute_algorithm: max
          margin: 1
          interval: 1
          override_linear_precision: [false, false, true]
          use_autocast_during_eval: false
        """,
    )
    assert str(target_from_yaml(path)) == (
        "ddp+bf16+fp8[amax_algo=max,amax_history=512,backend=te,format=e4m3,margin=1,"
        "override_linear_precision=false|false|true]"
    )


def test_fp8_backend_defaults_follow_accelerate(tmp_path):
    te = write(tmp_path, "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  backend: TE\n")
    assert str(target_from_yaml(te)) == "single+bf16+fp8[amax_history=1024,backend=te]"
    ao = write(tmp_path, "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  backend: AO\n")
    assert str(target_from_yaml(ao)) == "single+bf16+fp8[backend=torchao,scaling=current]"


def test_dynamo_inductor(tmp_path):
    path = write(
        tmp_path,
        """
        distributed_type: MULTI_GPU
        num_processes: 2
        mixed_precision: bf16
        dynamo_config:
          dynamo_backend: INDUCTOR
          dynamo_mode: max-autotune
          dynamo_use_fullgraph: true
          dynamo_use_regional_compilation: true
        """,
    )
    assert str(target_from_yaml(path)) == (
        "ddp+bf16+compile[dynamic=false,fullgraph=true,mode=max-autotune]"
    )


def test_regional_compilation_false_compiles_the_whole_model(tmp_path):
    text = "distributed_type: NO\ndynamo_config:\n  dynamo_backend: AOT_EAGER\n"
    absent = write(tmp_path, text)
    assert str(target_from_yaml(absent)) == "single+compile[backend=aot_eager,dynamic=false]"
    whole = write(tmp_path, text + "  dynamo_use_regional_compilation: false\n")
    assert str(target_from_yaml(whole)) == (
        "single+compile[backend=aot_eager,dynamic=false,scope=whole]"
    )


def test_old_format_keys(tmp_path):
    path = write(tmp_path, "distributed_type: NO\nfp16: true\ndynamo_backend: EAGER\n")
    assert str(target_from_yaml(path)) == "single+fp16+compile[backend=eager,dynamic=false]"


def test_cpu_single_process(tmp_path):
    path = write(
        tmp_path,
        """
        compute_environment: LOCAL_MACHINE
        distributed_type: 'NO'
        mixed_precision: 'no'
        use_cpu: true
        ipex_config:
          ipex: false
        dynamo_config: {}
        """,
    )
    config = read_accelerate_config(path)
    assert str(config.target) == "single"
    assert (config.num_processes, config.use_cpu, config.gradient_accumulation_steps) == (
        1,
        True,
        1,
    )


def test_xla_with_downcast_and_tp(tmp_path):
    xla = write(tmp_path, "distributed_type: XLA\nmixed_precision: bf16\ndowncast_bf16: 'yes'\n")
    assert str(target_from_yaml(xla)) == "xla+bf16[downcast=true]"
    tp = write(tmp_path, "distributed_type: TP\ntp_config:\n  tp_size: 4\n")
    assert str(target_from_yaml(tp)) == "tp[size=4]"


YAML_ERRORS = [
    (
        "distributed_type: NO\nfsdp_confg: {}\n",
        "fsdp_confg: unknown key; did you mean 'fsdp_config'?",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_stratgy: 1\n",
        "fsdp_config.fsdp_sharding_stratgy: unknown key; did you mean 'fsdp_sharding_strategy'?",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 1\n"
        "  fsdp_reshard_after_forward: false\n",
        "fsdp_config: fsdp_sharding_strategy means 'fsdp' but fsdp_reshard_after_forward means "
        "'zero2'; keep one of them",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: NO_WRAP\n",
        "fsdp_config.fsdp_auto_wrap_policy: 'NO_WRAP' cannot be honoured: each repeated block is "
        "its own unit",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: LOCAL_STATE_DICT\n",
        "fsdp_config.fsdp_state_dict_type: 'LOCAL_STATE_DICT' is not one of FULL_STATE_DICT, "
        "SHARDED_STATE_DICT; did you mean 'FULL_STATE_DICT'?",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n"
        "  fsdp_state_dict_type: FULL_STATE_DICT\n",
        "fsdp_config.fsdp_state_dict_type: 'full' has no meaning for 'ddp'; remove it",
    ),
    (
        "distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_sharding_strategy: 1\n",
        "fsdp_config: is set but distributed_type is MULTI_GPU; remove it, or use FSDP",
    ),
    (
        "distributed_type: MEGATRON_LM\n",
        "distributed_type: MEGATRON_LM cannot be honoured (Megatron-LM's engine is not run "
        "here); for tensor parallelism use TP (tp_config.tp_size), or FSDP to shard",
    ),
    (
        "distributed_type: MULTI_GPUS\n",
        "distributed_type: 'MULTI_GPUS' is not one of NO, MULTI_GPU, MULTI_CPU, MULTI_XPU, "
        "MULTI_NPU, MULTI_MLU, MULTI_MUSA, MULTI_HPU, FSDP, DEEPSPEED, XLA, TPU, TP; "
        "did you mean 'MULTI_GPU'?",
    ),
    (
        "mixed_precision: bf16\n",
        "distributed_type: missing; set one of NO, MULTI_GPU, MULTI_CPU, MULTI_XPU, MULTI_NPU, "
        "MULTI_MLU, MULTI_MUSA, MULTI_HPU, FSDP, DEEPSPEED, XLA, TPU, TP",
    ),
    (
        "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\n",
        "compute_environment: AMAZON_SAGEMAKER cannot be honoured: run on the machine",
    ),
    (
        "distributed_type: NO\ndebug: true\n",
        "debug: True cannot be honoured: distributed debug checks (ACCELERATE_DEBUG_MODE) are not "
        "implemented",
    ),
    (
        "distributed_type: NO\ntpu_name: my-pod\n",
        "tpu_name: 'my-pod' cannot be honoured: launching on TPU pods is not supported",
    ),
    (
        "distributed_type: NO\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n",
        "megatron_lm_config: {'megatron_lm_tp_degree': 2} cannot be honoured: Megatron-LM is not "
        "supported",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n"
        "  offload_param_device: nvme\n",
        "deepspeed_config.offload_param_device: nvme offload cannot be honoured; use cpu or none",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
        "  gradient_clipping: 1.0\n",
        "deepspeed_config.gradient_clipping: 1.0 cannot be honoured: clip in the training loop "
        "with clip_grad_norm_",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 1\n"
        "  offload_optimizer_device: cpu\n",
        "'offload' needs one of 'fsdp', 'zero2', 'zero3', 'hsdp': offload moves sharded state to "
        "the CPU",
    ),
    (
        "distributed_type: NO\nmixed_precision: bf16\nfp8_config:\n  backend: TE\n",
        "fp8_config: is set but mixed_precision is bf16; remove it, or use fp8",
    ),
    (
        "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  backend: TEE\n",
        "fp8_config.backend: 'TEE' is not one of TE, MSAMP, MS-AMP, AO; did you mean 'TE'?",
    ),
    (
        "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  amax_history_len: 0\n",
        "fp8_config.amax_history_len: bad value 0: must be >= 1",
    ),
    (
        "distributed_type: NO\ndynamo_config:\n  dynamo_backend: 'NO'\n"
        "  dynamo_use_fullgraph: true\n",
        "dynamo_config.dynamo_use_fullgraph: is set but dynamo_backend is NO; remove it",
    ),
    (
        "distributed_type: NO\nmixed_precision: fp16\ndowncast_bf16: 'yes'\n",
        "downcast_bf16: applies only with mixed_precision: bf16",
    ),
    (
        "distributed_type: MULTI_GPU\nmixed_precision: bf16\ndowncast_bf16: 'yes'\n",
        "bf16[downcast=true] needs 'xla': it is XLA's XLA_DOWNCAST_BF16",
    ),
    (
        "distributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 2\n",
        "machine_rank: must be below num_machines (2), got 2",
    ),
    (
        "distributed_type: NO\nnum_processes: 4\n",
        "num_processes: distributed_type NO runs one process, got 4",
    ),
    (
        "distributed_type: MULTI_GPU\nnum_processes: many\n",
        "num_processes: expected an integer, got 'many'",
    ),
    (
        "distributed_type: MULTI_GPU\nuse_cpu: maybe\n",
        "use_cpu: expected true or false, got 'maybe'",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"), YAML_ERRORS, ids=[m.split(":")[0] for _, m in YAML_ERRORS]
)
def test_yaml_errors_name_the_file_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(TargetError) as info:
        read_accelerate_config(path)
    assert str(info.value) == f"{path}: {message}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- distributed_type: NO\n", "expected a mapping of Accelerate config keys, got list"),
        ("", "expected a mapping of Accelerate config keys, got NoneType"),
        ("distributed_type: [NO\n", "not valid YAML: "),
    ],
)
def test_yaml_that_is_not_a_mapping(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(TargetError) as info:
        read_accelerate_config(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_target_from_yaml_is_exported_at_the_package_top(tmp_path):
    path = write(tmp_path, "distributed_type: MULTI_GPU\nmixed_precision: bf16\n")
    assert retarget.target_from_yaml is target_from_yaml
    assert retarget.target_from_yaml(path) == Target.parse("ddp+bf16")
