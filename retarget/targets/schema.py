"""The target schema: every part name, what it does and its options (kind, default, allowed
values, doc), in canonical order.

A table, not if-chains: the grammar (grammar.py) parses specs against it, the rules (rules.py)
say which parts and options combine, and compat/accelerate/config_yaml.py maps Accelerate's
keys onto it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from retarget.targets.options import (
    Option,
    bool_option,
    enum_option,
    float_option,
    int_option,
    list_option,
    ref_option,
)

__all__ = ["PARTS", "PART_ORDER", "Option", "PartSchema"]


@dataclass(frozen=True)
class PartSchema:
    """What a part does and the options it takes."""

    doc: str
    options: Mapping[str, Option] = field(default_factory=dict)


_DDP = {
    "bucket_cap_mb": int_option(25, "gradient bucket size in MiB for the all-reduce", low=1),
    "find_unused_parameters": bool_option(
        False, "tolerate parameters that get no gradient in a step"
    ),
    "static_graph": bool_option(False, "the set of used parameters never changes between steps"),
    "gradient_as_bucket_view": bool_option(
        False, "gradients are views into the buckets (less memory)"
    ),
    "broadcast_buffers": bool_option(
        True, "broadcast buffers (BatchNorm stats) from rank 0 in forward"
    ),
}
_FSDP_COMMON = {
    "min_params": int_option(0, "blocks with fewer parameters are not their own FSDP unit"),
    "cpu_ram_efficient_loading": bool_option(
        False, "only rank 0 loads weights; the others get a copy"
    ),
    "state_dict": enum_option("sharded", "full|sharded", "state_dict(): full tensors or shards"),
    "sync_module_states": bool_option(
        True, "broadcast rank 0's parameters and buffers when wrapping"
    ),
}
_FSDP = {"reshard": bool_option(True, "free gathered parameters after forward (false: zero2)")}
_FSDP.update(_FSDP_COMMON)
_AUTOCAST = {
    "keep_fp32": list_option(
        "softmax|norm|loss",
        "softmax|norm|loss|exp|log|pow|reduce|cumsum",
        "op families kept in float32 inside autocast regions",
    ),
    "autocast_eval": bool_option(True, "autocast in eval mode too"),
}
# The table of parts, in canonical order: str(target) lists parts in this order.
PARTS: dict[str, PartSchema] = {
    "single": PartSchema("one process, no distribution"),
    "ddp": PartSchema("replicate parameters, all-reduce gradients (DistributedDataParallel)", _DDP),
    "fsdp": PartSchema("shard parameters, gradients and optimizer state (FSDP2, ZeRO-3)", _FSDP),
    "zero1": PartSchema("ddp plus optimizer-state sharding (ZeRO-1)", _DDP),
    "zero2": PartSchema("fsdp keeping parameters gathered from forward to backward", _FSDP_COMMON),
    "zero3": PartSchema("fsdp under its DeepSpeed name", _FSDP_COMMON),
    "hsdp": PartSchema(
        "shard within a group of processes, replicate across groups",
        {
            "replicate": int_option(0, "number of replica groups; 0: one per node"),
            "shard": int_option(0, "processes per shard group; 0: processes per node"),
            **_FSDP,
        },
    ),
    "tp": PartSchema(
        "tensor parallelism over Linear layers",
        {
            "size": int_option(
                0, "tensor-parallel degree; 0: the world, or what data parallel leaves"
            ),
            "plan": ref_option(
                "auto",
                "auto|hf",
                "how layers are split; auto: derived from the graphs; hf: the model config's "
                "base_model_tp_plan; PKG.MODULE:NAME: a hand plan (globs -> styles, or a TpPlan)",
            ),
            "sequence_parallel": bool_option(
                False, "also shard norms and dropout along the sequence"
            ),
            "loss_parallel": bool_option(
                False, "keep the LM head's logits sharded on the vocabulary into the loss"
            ),
            "async_tp": bool_option(
                False,
                "torch's async tensor parallelism: inductor overlaps the sequence all-gather / "
                "reduce-scatter with the matmuls (CUDA, compile[backend=inductor], "
                "sequence_parallel=true)",
            ),
        },
    ),
    "cp": PartSchema(
        "context parallelism: the sequence split over a group of ranks, attention across it",
        {
            "size": int_option(
                0, "context-parallel degree; 0: the world, or what data parallelism leaves"
            ),
            "attention": enum_option(
                "ring",
                "ring|allgather|ulysses",
                "ring: keys/values passed round the group; allgather: gathered whole; "
                "ulysses: all-to-all from sequence shards to head shards",
            ),
            "load_balance": bool_option(
                True, "zig-zag chunks (rank i holds chunks i and 2N-1-i): even causal work"
            ),
        },
    ),
    "pp": PartSchema(
        "pipeline parallelism: the repeated blocks cut into stages over the ranks",
        {
            "size": int_option(0, "pipeline stages (ranks); 0: the world"),
            "schedule": enum_option(
                "1f1b",
                "1f1b|gpipe|interleaved-1f1b|zero-bubble",
                "how microbatches flow through the stages (torch.distributed.pipelining)",
            ),
            "microbatches": int_option(0, "microbatches per batch; 0: 2 x size", low=0),
            "stages_per_rank": int_option(
                0, "stages each rank holds; 0: 2 for interleaved-1f1b, else 1", low=0
            ),
            "cuts": enum_option(
                "auto",
                "auto|blocks",
                "where stages may begin: blocks only, or (auto) also inside blocks when whole "
                "blocks balance worse than 1.10",
            ),
        },
    ),
    "xla": PartSchema(
        "XLA devices (torch-xla)",
        {
            "spmd": bool_option(True, "one SPMD program over every device (else one device)"),
            "sharding": enum_option(
                "fsdp", "fsdp|replicate", "SPMD: blocks' parameters sharded on dim 0, or none"
            ),
        },
    ),
    "bf16": PartSchema(
        "bfloat16 autocast",
        {**_AUTOCAST, "downcast": bool_option(False, "XLA: store float32 as bf16 (downcast_bf16)")},
    ),
    "fp16": PartSchema(
        "float16 autocast with a dynamic loss scaler",
        {
            **_AUTOCAST,
            "init_scale": float_option(65536.0, "initial loss scale", low=0),
            "growth_factor": float_option(
                2.0, "scale multiplier after growth_interval good steps", 1
            ),
            "backoff_factor": float_option(
                0.5, "scale multiplier after an overflow", low=0, high=1
            ),
            "growth_interval": int_option(
                2000, "overflow-free steps before the scale grows", low=1
            ),
        },
    ),
    "fp8": PartSchema(
        "float8 matmuls in Linear layers (the rest runs in bf16 when bf16 is given)",
        {
            "backend": enum_option("auto", "auto|native|torchao|te|msamp", "fp8 implementation"),
            "format": enum_option("hybrid", "hybrid|e4m3", "hybrid: e4m3 forward, e5m2 gradients"),
            "scaling": enum_option("delayed", "delayed|current|rowwise", "how scales are computed"),
            "amax_history": int_option(16, "length of the amax history (delayed scaling)", low=1),
            "amax_algo": enum_option(
                "most_recent", "max|most_recent", "scale from the amax history"
            ),
            "margin": int_option(0, "margin of the scale, as a power of two"),
            "interval": int_option(1, "steps between scale updates", low=1),
            "min_size": int_option(
                1048576, "Linears whose weight has fewer elements are not swapped"
            ),
            "include": list_option(
                "", "", "swap only Linears whose name matches a pattern (fnmatch)"
            ),
            "exclude": list_option("", "", "never swap Linears whose name matches, e.g. lm_head"),
            "override_linear_precision": Option(
                "bools", (False,) * 3, "fprop|dgrad|wgrad GEMMs in high precision (te)", length=3
            ),
            "autocast_eval": bool_option(
                False, "fp8 in eval mode too (te's use_autocast_during_eval)"
            ),
            "opt_level": enum_option("o2", "o1|o2", "MS-AMP optimisation level"),
        },
    ),
    "quant": PartSchema(
        "frozen 4/8-bit weights in Linear layers (weight-only; train adapters such as LoRA on top)",
        {
            "bits": enum_option("4", "4|8", "bits per weight"),
            "type": enum_option(
                "auto", "auto|nf4|fp4|int8", "the code: auto is nf4 for 4 bits, int8 for 8"
            ),
            "backend": enum_option(
                "auto", "auto|native|bnb|torchao", "implementation (auto: native, torch ops)"
            ),
            "compute": enum_option(
                "auto",
                "auto|bf16|fp16|fp32",
                "dtype of the matmul: auto is the target's bf16/fp16, else the input's",
            ),
            "double_quant": bool_option(False, "4-bit: quantize the block scales to int8 too"),
            "block_size": int_option(64, "4-bit: weights per scale block (even)", low=2),
            "skip": list_option("", "", "never quantize Linears whose name matches (fnmatch)"),
        },
    ),
    "ac": PartSchema(
        "activation checkpointing of repeated blocks",
        {
            "policy": enum_option(
                "full", "full|selective|budget", "recompute blocks, ops, or by budget"
            ),
            "every": int_option(1, "checkpoint every n-th block", low=1),
            "budget": Option("budget", None, "activations to keep: a fraction or a size (8GiB)"),
        },
    ),
    "offload": PartSchema(
        "keep sharded state in CPU memory",
        {
            "params": bool_option(
                True, "parameters and their gradients live on the CPU between uses"
            ),
            "optimizer": bool_option(True, "optimizer state lives on the CPU, which runs the step"),
            "pin_memory": enum_option("auto", "auto|true|false", "pin the CPU copies"),
        },
    ),
    "compile": PartSchema(
        "torch.compile",
        {
            "backend": Option("name", "inductor", "torch.compile backend"),
            "mode": enum_option(
                "default",
                "default|reduce-overhead|max-autotune|max-autotune-no-cudagraphs",
                "torch.compile mode",
            ),
            "fullgraph": bool_option(False, "fail on graph breaks instead of splitting"),
            "dynamic": enum_option(
                "auto", "auto|true|false", "dynamic shapes: auto, always or never"
            ),
            "scope": enum_option(
                "regions",
                "regions|whole",
                "regions: compile each block type's graph once, reuse it for its repeats; "
                "whole: the whole model's forward",
            ),
        },
    ),
    "powersgd": PartSchema(
        "PowerSGD low-rank gradient compression (DDP comm hook)",
        {
            "rank": int_option(1, "rank of the gradient approximation", low=1),
            "start_iter": int_option(10, "plain all-reduce for this many steps first"),
            "min_compression_rate": float_option(
                2.0, "compress only above this rate", 1, strict=False
            ),
            "wrapper": enum_option(
                "none", "none|fp16|bf16", "also cast to this dtype (comm_wrapper)"
            ),
            "error_feedback": bool_option(True, "carry the compression error to the next step"),
            "warm_start": bool_option(True, "reuse last step's factors as the starting point"),
        },
    ),
    "fp16-comm": PartSchema("all-reduce gradients in float16 (DDP comm hook)"),
    "bf16-comm": PartSchema("all-reduce gradients in bfloat16 (DDP comm hook)"),
    "stream": PartSchema(
        "inference: keep weights off the execution device, bring each block in to run it",
        {
            "from": enum_option("disk", "disk|cpu", "where the weights that do not fit live"),
            "prefetch": int_option(1, "blocks read ahead on a background thread", low=0),
            "max_memory": Option(
                "budget",
                None,
                "weights kept resident: a size (2GB) or a share of the model (0.25); "
                "default 90% of free memory",
            ),
        },
    ),
}
#: Each part's place in canonical order.
PART_ORDER = {name: i for i, name in enumerate(PARTS)}
