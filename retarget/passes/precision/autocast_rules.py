"""The tables insert_autocast drives: which ops run in low precision, which stay float32.

Every decision is data here, not an if-chain in the pass (a table a reader can audit,
and a test can walk, in one place):

- `LOWER`: the matmul class (torch.autocast's `lower_precision_fp` list). Their floating inputs
  are cast to bf16/fp16 and their output stays in it.
- `ISLANDS`: op -> island kind. An island whose kind is in `keep_fp32` gets its inputs cast back
  to float32. The kinds are the target's `keep_fp32` choices (retarget/targets/schema.py).
- `PATTERNS`: op chains that form one island together, e.g. the RMSNorm of HF Llama written
  as `pow -> mean -> add -> rsqrt` (each op alone would be a pow / reduce / pow island).
- `CONDITIONS`: an island kind that applies only when a predicate holds (large reductions).
- `FOLLOWS` and `PROMOTES`: how an op's output dtype relates to its inputs, so the pass can
  skip casts that are provably no-ops; an op in neither table is assumed nothing about.
- `LOWER_MODULES`: leaf modules that run under torch.autocast: outside captured regions (glue),
  and inside them where a graph calls the module instead of a functional matmul.

Ops are named by `op_name(node)`: the aten packet name (`aten.linear.default` -> "linear"), a
function's `__name__` (`torch._C._nn.linear` -> "linear"), or a method name (`x.softmax`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from retarget.core.module_record import record_of
from retarget.core.modules import base_class
from retarget.ir.nodes import op_name, traced_value

#: Island kinds, as `bf16[keep_fp32=...]` spells them.
KINDS = ("softmax", "norm", "loss", "exp", "log", "pow", "reduce", "cumsum")

#: Marks a node of the matmul class in `classify`'s result.
LOWER = "lower"
#: Marks a `call_module` of a Linear/Conv leaf (a graph that calls the module, e.g. an FP8 swap's).
MODULE = "module"

#: Ops that run in low precision (torch.autocast's lower_precision_fp list, CPU and CUDA).
LOWER_OPS = frozenset(
    {
        "linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr",
        "einsum", "linalg_vecdot", "chain_matmul", "linalg_multi_dot",
        "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "multi_head_attention_forward",
        "_native_multi_head_attention",
    }
)  # fmt: skip


def _kind(kind: str, *names: str) -> dict[str, str]:
    assert kind in KINDS, kind
    return dict.fromkeys(names, kind)


#: Op -> island kind (the ops torch.autocast keeps in float32 on CUDA, grouped).
ISLANDS: dict[str, str] = {
    **_kind("softmax", "softmax", "_softmax", "log_softmax", "_log_softmax", "softmin"),
    **_kind(
        "norm",
        "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "batch_norm",
        "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
        "group_norm", "native_group_norm", "instance_norm", "local_response_norm", "normalize",
    ),
    **_kind(
        "loss",
        "cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward",
        "nll_loss2d", "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss",
        "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
        "soft_margin_loss", "poisson_nll_loss", "gaussian_nll_loss", "cosine_embedding_loss",
        "margin_ranking_loss", "hinge_embedding_loss", "triplet_margin_loss",
        "multi_margin_loss", "multilabel_margin_loss", "ctc_loss",
    ),
    **_kind("exp", "exp", "expm1", "exp2", "sinh", "cosh", "softplus"),
    **_kind("log", "log", "log2", "log10", "log1p", "logsumexp", "xlogy"),
    **_kind("pow", "pow", "float_power", "rsqrt", "reciprocal"),
    **_kind("reduce", "sum", "mean", "var", "std", "var_mean", "std_mean", "prod", "norm",
            "linalg_vector_norm", "nansum", "nanmean"),
    **_kind("cumsum", "cumsum", "cumprod", "logcumsumexp"),
}  # fmt: skip

#: Chains (producer first, each op's first input is the previous op) that are one island.
PATTERNS: tuple[tuple[tuple[str, ...], str], ...] = (
    # RMSNorm as HF Llama/T5 write it: x * rsqrt(mean(x ** 2) + eps).
    (("pow", "mean", "add", "rsqrt"), "norm"),
    (("pow", "mean", "rsqrt"), "norm"),
    (("pow", "mean", "add", "sqrt"), "norm"),
)

#: Reductions over fewer elements than this keep their inputs' precision.
LARGE_REDUCTION = 1024


def _reduces_many(node: fx.Node) -> bool:
    source = node.args[0] if node.args else None
    before, after = traced_value(source), traced_value(node)
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return True  # unknown size: treat as large, the safe side
    try:
        return int(before.numel()) >= LARGE_REDUCTION * max(int(after.numel()), 1)
    except (TypeError, RuntimeError):  # symbolic sizes
        return True


#: Island kinds that apply only when the predicate holds for the node.
CONDITIONS: dict[str, Callable[[fx.Node], bool]] = {"reduce": _reduces_many}

#: Ops whose output has their floating inputs' dtype (views, unary elementwise, activations).
FOLLOWS = frozenset(
    {
        "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "contiguous",
        "clone", "slice", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "split",
        "split_with_sizes", "chunk", "unbind", "narrow", "getitem", "alias", "detach",
        "dropout", "native_dropout", "relu", "gelu", "silu", "tanh", "sigmoid", "neg", "abs",
        "mul", "add", "sub", "div", "cat", "stack", "max_pool2d", "avg_pool2d",
        "adaptive_avg_pool2d", "constant_pad_nd", "pad", "masked_fill", "where",
        # island ops left to the input dtype when their kind is not kept in float32
        "softmax", "_softmax", "log_softmax", "_log_softmax", "exp", "log", "pow", "rsqrt",
        "sum", "mean", "cumsum",
    }
)  # fmt: skip

#: Ops that apply type promotion: a float32 operand with dimensions makes the result float32.
PROMOTES = frozenset(
    {"add", "sub", "rsub", "mul", "div", "true_divide", "where", "cat", "stack", "maximum",
     "minimum"}
)  # fmt: skip

#: Ops that refuse a Python float outside their tensor's dtype range ("value cannot be converted
#: to type c10::BFloat16 without overflow", measured on torch 2.13), where arithmetic would
#: give inf. A constant traced in float32, typically `torch.finfo(x.dtype).min`, meets a low
#: precision tensor here only because the graph form lowered `x`; eager under autocast would
#: have read the low dtype's limit. The rewrite saturates such a constant to that limit.
#: `where` takes the constant silently as -inf, which turns a fully masked softmax row into NaN
#: where eager's finite limit gives a uniform row: saturated too.
SATURATES = frozenset(
    {"masked_fill", "masked_fill_", "fill", "fill_", "clamp", "clamp_", "clamp_min",
     "clamp_min_", "clamp_max", "clamp_max_", "full_like", "new_full", "index_fill",
     "index_fill_", "where"}
)  # fmt: skip

#: Leaf modules that run under autocast outside regions, and the op each one is.
LOWER_MODULES: dict[type[nn.Module], str] = {
    nn.Linear: "linear",
    nn.Bilinear: "linear",
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.ConvTranspose1d: "conv_transpose1d",
    nn.ConvTranspose2d: "conv_transpose2d",
    nn.ConvTranspose3d: "conv_transpose3d",
}


def classify(graph: fx.Graph, root: nn.Module) -> dict[fx.Node, str]:
    """Node -> LOWER, MODULE or an island kind, for every node the tables name."""
    decisions: dict[fx.Node, str] = {}
    for node in graph.nodes:
        name = op_name(node)
        if node.op == "call_module":
            if isinstance(root.get_submodule(node.target), tuple(LOWER_MODULES)):
                decisions[node] = MODULE
        elif name in LOWER_OPS:
            decisions[node] = LOWER
        elif name in ISLANDS and CONDITIONS.get(ISLANDS[name], _always)(node):
            decisions[node] = ISLANDS[name]
    for node in graph.nodes:
        for chain, kind in PATTERNS:
            for member in _match_chain(node, chain):
                decisions[member] = kind
    return decisions


def _always(node: fx.Node) -> bool:
    return True


def _match_chain(last: fx.Node, chain: tuple[str, ...]) -> list[fx.Node]:
    """The nodes of `chain` ending at `last`, walking first inputs backwards; [] if no match."""
    members = []
    node: Any = last
    for name in reversed(chain):
        if not isinstance(node, fx.Node) or op_name(node) != name:
            return []
        members.append(node)
        node = node.args[0] if node.args else None
    return members


def is_plain_leaf(module: nn.Module) -> bool:
    """A Linear/Conv of exactly a LOWER_MODULES class (not a subclass such as an FP8 Linear),
    or one whose autocast policy is already installed."""
    if type(module) in LOWER_MODULES:
        return True
    return record_of(module).autocast is not None and base_class(module) in LOWER_MODULES
