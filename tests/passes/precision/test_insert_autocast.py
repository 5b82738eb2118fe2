"""insert_autocast (bf16 / fp16): numerics against fp32 eager, what really runs in low precision,
the eager and glue forms, autocast_eval, the golden rewrite, no-op and bad input.

Tolerances were measured on this CPU (AVX512-BF16) at batch 2 and are stated where they are used.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import retarget
from retarget.core.module_record import record_of
from retarget.core.modules import original_class
from retarget.passes.precision.autocast_graph import rewrite_graph
from retarget.passes.precision.insert_autocast import AutocastOptions
from retarget.runtime.scaler import LossScaler, make_loss_scaler
from retarget.targets.grammar import TargetError
from tests.conftest import step, to_device
from tests.zoo import SEQ, VOCAB, ZOO, call, first_block_call, loss_of

#: aten ops (dispatch level) that are the matmul class: what must see bf16 inputs.
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product")

# Measured |loss(bf16) - loss(fp32)| on the zoo: at most 6.6e-4 (control_flow_model).
LOSS_ATOL = 3e-3
# Measured ||grads(bf16) - grads(fp32)|| / ||grads(fp32)||: 7.1e-2 on small_cnn (BatchNorm right
# after bf16 convs, batch 2; torch.autocast itself gives 8.3e-2 there), at most 1.3e-2 elsewhere.
GRAD_RTOL = {"small_cnn": 0.15}
GRAD_RTOL_DEFAULT = 0.03
# fp16 (10 mantissa bits), batch 1: loss within 1.8e-5, grads 2.5e-3 (mnist_cnn), 6.9e-4 (llama).
FP16_LOSS_ATOL, FP16_GRAD_RTOL = 5e-4, 1e-2
# 30 AdamW steps of tiny_llama (loss 4.91 -> 2.25): bf16 tracks fp32 within 1.5e-2 per step.
CURVE_ATOL = 0.05


pytestmark = pytest.mark.usefixtures("one_thread")


class DtypeRecorder(TorchDispatchMode):
    """Records the floating dtypes reaching each aten op, by op name (`mm`, `_softmax` ...)."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        dtypes = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
        self.seen[func.overloadpacket.__name__] |= dtypes
        return func(*args, **kwargs)

    def dtypes_of(self, *prefixes: str) -> set[torch.dtype]:
        found = [d for name, d in self.seen.items() if name.startswith(prefixes)]
        assert found, f"no op named {prefixes} ran; ran: {sorted(self.seen)}"
        return set().union(*found)


@functools.cache
def compiled_zoo(name: str, target: str = "bf16", device: torch.device | None = None):
    """(eager fp32 model, compiled twin sharing its weights); read-only uses only."""
    entry = ZOO[name]
    model = to_device(entry.factory(), device or torch.device("cpu"))
    example = to_device(entry.inputs(2), device or torch.device("cpu"))
    return model, retarget.compile_for(model, target, example_inputs=example)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_zoo():
    """The cache serves this module's tests; the models go with the module."""
    yield
    compiled_zoo.cache_clear()


def grad_error(reference: dict, got: dict) -> float:
    assert reference.keys() == got.keys()
    assert all(g.dtype == torch.float32 for g in got.values())
    diff = sum(((reference[k] - got[k]) ** 2).sum() for k in reference) ** 0.5
    return (diff / sum((g**2).sum() for g in reference.values()) ** 0.5).item()


def autocast_record(compiled) -> dict:
    return next(r for r in compiled.history if r.name == "insert_autocast")


# -- small models with one obvious rewrite ----------------------------------------------------
class MLPBlock(nn.Module):
    """Ends in a Linear: the region's output is bf16 until cast back."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(dim, 16)
        self.fc2 = nn.Linear(16, dim)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class AttentionBlock(nn.Module):
    """Eager attention: a softmax on a bf16 score and a LayerNorm, the two default islands."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1)
        return self.norm(x + attn @ v)


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def stack(block: type[nn.Module], target: str = "bf16"):
    torch.manual_seed(0)
    model = Stack(block)
    return model, retarget.compile_for(model, target, example_inputs=torch.randn(2, 4, 8))


# -- numerics -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ZOO))
def test_bf16_forward_backward_within_tolerance_of_fp32(name, device):
    model, compiled = compiled_zoo(name, device=device)
    inputs = to_device(ZOO[name].inputs(2), device)
    loss, grads = step(model, inputs)
    loss_bf16, grads_bf16 = step(compiled, inputs)
    assert loss_bf16.dtype == torch.float32
    assert abs(loss_bf16 - loss).item() <= LOSS_ATOL
    error = grad_error(grads, grads_bf16)
    assert error <= GRAD_RTOL.get(name, GRAD_RTOL_DEFAULT), error
    assert error > 1e-4, "grads equal fp32's: nothing ran in bf16"


@pytest.mark.parametrize("name", ["tiny_llama", "mnist_cnn"])
def test_fp16_forward_backward_within_tolerance_of_fp32(name, device):
    # fp16 matmuls are very slow on this CPU: the two smallest models, batch 1.
    entry = ZOO[name]
    model = to_device(entry.factory(), device)
    inputs = to_device(entry.inputs(1), device)
    compiled = retarget.compile_for(model, "fp16", example_inputs=inputs)
    loss, grads = step(model, inputs)
    loss_fp16, grads_fp16 = step(compiled, inputs)
    assert abs(loss_fp16 - loss).item() <= FP16_LOSS_ATOL
    assert 1e-5 < grad_error(grads, grads_fp16) <= FP16_GRAD_RTOL


def test_bf16_training_tracks_the_fp32_loss_curve():
    entry = ZOO["tiny_llama"]

    def batch(index: int) -> dict:
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(index % 4))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def losses(model: nn.Module) -> torch.Tensor:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for index in range(30):
            loss = loss_of(call(model, batch(index)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        return torch.tensor(curve)

    fp32 = losses(entry.factory())
    bf16 = losses(retarget.compile_for(entry.factory(), "bf16", example_inputs=batch(0)))
    assert fp32[0] - fp32[-1] > 2.0, "the run does not learn: the comparison means nothing"
    gap = (bf16 - fp32).abs().max().item()
    assert 0 < gap <= CURVE_ATOL, gap


def test_verify_checks_outputs_within_the_stated_tolerance():
    entry = ZOO["control_flow_model"]
    compiled = retarget.compile_for(
        entry.factory(), "bf16", example_inputs=entry.inputs(2), verify=True
    )
    assert "approx" in autocast_record(compiled).numerics


class MaskedAttention(nn.Module):
    """Masks scores with the low dtype's own limit, as DeBERTa and GPT-2 write it: a trace in
    float32 bakes float32's `finfo.min`, which bf16 cannot hold."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.qk = nn.Linear(dim, 2 * dim)

    def forward(self, x, keep):
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = q @ k.transpose(-1, -2)
        filled = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        chosen = torch.where(keep, scores, torch.finfo(scores.dtype).min)
        return x + (torch.softmax(filled, -1) + torch.softmax(chosen, -1)) @ x


def test_a_float32_limit_meeting_a_lowered_value_is_the_low_dtypes_limit_as_eager_reads_it():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([MaskedAttention() for _ in range(2)])

        def forward(self, x, keep):
            for block in self.blocks:
                x = block(x, keep)
            return x

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 4, 8)
    keep = torch.ones(2, 4, 4, dtype=torch.bool)
    keep[0, 1] = False  # a fully masked row: NaN if the limit became -inf
    keep[1, :, 2] = False
    compiled = retarget.compile_for(model, "bf16", example_inputs=(x, keep))
    saturated = [r.representative().gm.meta["autocast"]["saturated"]
                 for r in compiled.program.regions]  # fmt: skip
    assert saturated == [2], saturated
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x, keep)
    got = compiled(x, keep)
    assert torch.isfinite(got).all()
    # the softmax island runs in float32 here, in bf16 under torch.autocast
    assert torch.allclose(got, expected.float(), atol=2e-2)


def _deberta_v2():
    """DebertaV2ForSequenceClassification at its default config, sizes shrunk."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    config = DebertaV2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    return DebertaV2ForSequenceClassification(config)


@pytest.mark.parametrize("target", ["bf16", "fp16", "bf16+ac"])
def test_deberta_v2_trains_in_low_precision_where_torch_autocast_does(target):
    model = _deberta_v2()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, SEQ // 2 :] = 0  # padding: masked keys
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}
    compiled = retarget.compile_for(model, target, example_inputs=inputs)
    assert not [r.name for r in compiled.program.regions if r.eager_only]
    loss, grads = step(model, inputs)
    low_loss, low_grads = step(compiled, inputs)
    assert abs(low_loss - loss).item() <= LOSS_ATOL
    assert 1e-5 < grad_error(grads, low_grads) <= GRAD_RTOL_DEFAULT


# -- purpose ------------------------------------------------------------------------------------
def test_region_matmuls_run_in_bf16_norm_islands_in_fp32_and_outputs_leave_in_fp32():
    model, compiled = compiled_zoo("tiny_llama")
    _, args, kwargs = first_block_call(model, ZOO["tiny_llama"].inputs(2), "LlamaDecoderLayer")
    recorder = DtypeRecorder()
    with recorder:  # grad on: the signature compile_for captured
        out = compiled.model.layers[0](*args, **kwargs)
    assert recorder.dtypes_of(*MATMULS) == {torch.bfloat16}
    # Llama's RMSNorm (pow -> mean -> add -> rsqrt) is a norm island.
    for op in ("pow", "mean", "rsqrt"):
        assert recorder.dtypes_of(op) == {torch.float32}, op
    assert all(t.dtype == torch.float32 for t in tree_flatten(out)[0] if torch.is_tensor(t))


def test_softmax_and_layer_norm_islands_run_in_fp32_and_keep_fp32_is_honoured():
    x = torch.randn(2, 4, 8)
    for target, softmax_dtype in (
        ("bf16", torch.float32),
        ("bf16[keep_fp32=norm]", torch.bfloat16),
    ):
        _, compiled = stack(AttentionBlock, target)
        recorder = DtypeRecorder()
        with recorder:  # grad on: the signature compile_for captured
            out = compiled(x)
        assert recorder.dtypes_of(*MATMULS) == {torch.bfloat16}
        assert recorder.dtypes_of("_softmax") == {softmax_dtype}, target
        assert recorder.dtypes_of("native_layer_norm") == {torch.float32}
        assert out.dtype == torch.float32


@pytest.mark.parametrize(
    "name, island", [("mnist_cnn", "_log_softmax"), ("small_cnn", "native_batch_norm")]
)
def test_cnn_islands_see_fp32_after_bf16_layers(name, island):
    _, compiled = compiled_zoo(name)
    recorder = DtypeRecorder()
    with recorder:  # grad on: the signature compile_for captured
        compiled(ZOO[name].inputs(2))
    assert recorder.dtypes_of("convolution") == {torch.bfloat16}
    assert recorder.dtypes_of(island) == {torch.float32}


def test_glue_lm_head_runs_in_bf16_and_the_loss_in_fp32():
    model, compiled = compiled_zoo("tiny_llama")
    hidden = torch.randn(2, SEQ, model.config.hidden_size)
    recorder = DtypeRecorder()
    with recorder:  # grad on: the signature compile_for captured
        logits = compiled.lm_head(hidden)
    assert recorder.dtypes_of("mm", "addmm") == {torch.bfloat16}
    assert logits.dtype == torch.float32
    out = call(compiled, ZOO["tiny_llama"].inputs(2))
    assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.float32
    assert any("glue: lm_head (Linear)" in note for note in autocast_record(compiled).notes)


def test_uncapturable_regions_run_their_eager_forward_under_autocast():
    model, compiled = compiled_zoo("uncapturable_block_model")
    (region,) = compiled.program.regions
    assert region.frontend == "eager"
    recorder = DtypeRecorder()
    with recorder:  # grad on: the signature compile_for captured
        out = compiled.blocks[0](torch.randn(2, 16))
    assert recorder.dtypes_of("mm", "addmm") == {torch.bfloat16}
    assert out.dtype == torch.float32
    # Fed bfloat16 (FSDP's mixed precision casts a unit's inputs) it hands bfloat16 on, as its
    # graph form would: a float32 output would meet the next unit's bfloat16 norm weights.
    assert compiled.blocks[0](torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    record = autocast_record(compiled)
    assert record.stats["regions"]["blocks.*"]["form"] == "eager"
    assert any(note.startswith("blocks.*: eager form") for note in record.notes)


@pytest.mark.parametrize("autocast_eval", [True, False])
def test_autocast_eval_decides_the_precision_of_eval_mode(autocast_eval):
    entry = ZOO["tiny_llama"]
    model = entry.factory()
    target = f"bf16[autocast_eval={str(autocast_eval).lower()}]"
    compiled = retarget.compile_for(model, target, example_inputs=entry.inputs(2))
    model.eval()
    compiled.eval()
    with torch.no_grad():
        call(compiled, entry.inputs(2))  # captures the eval-mode signature (and checks it in fp32)
        expected = call(model, entry.inputs(2)).loss
    recorder = DtypeRecorder()
    with recorder, torch.no_grad():  # the eval signature captured just above
        got = call(compiled, entry.inputs(2)).loss
    eval_dtype = torch.bfloat16 if autocast_eval else torch.float32
    assert recorder.dtypes_of(*MATMULS) == {eval_dtype}
    if not autocast_eval:
        assert torch.equal(got, expected), "eval mode must be exactly fp32"
    compiled.train()
    train_recorder = DtypeRecorder()
    with train_recorder:
        call(compiled, entry.inputs(2))
    assert torch.bfloat16 in train_recorder.dtypes_of(*MATMULS)


def test_fp16_plans_a_loss_scaler_from_the_target_options_and_bf16_none():
    entry = ZOO["control_flow_model"]
    target = "fp16[init_scale=1024,growth_interval=10,backoff_factor=0.25]"
    compiled = retarget.compile_for(entry.factory(), target, example_inputs=entry.inputs(2))
    plan = compiled.program.plan
    assert plan.loss_scaler.options() == {
        "init_scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.25,
        "growth_interval": 10,
    }
    scaler = make_loss_scaler(plan, "cpu")
    assert isinstance(scaler, LossScaler) and scaler.scale_value == 1024.0
    _, bf16 = compiled_zoo("control_flow_model")
    assert bf16.program.plan.loss_scaler is None
    assert make_loss_scaler(bf16.program.plan, "cpu") is None


# -- structure ----------------------------------------------------------------------------------
# The weights go to cast_weight_linear uncast: it casts them itself, and again in backward,
# rather than keep a bf16 copy of each from forward to backward.
GOLDEN_MLP = """\
to_dtype = torch.ops.aten.to.dtype(args_0, torch.bfloat16)
to_dtype_2 = torch.ops.aten.to.dtype(fc1_bias, torch.bfloat16)
linear = cast_weight_linear(to_dtype, fc1_weight, to_dtype_2, torch.bfloat16)
relu = torch.ops.aten.relu.default(linear)
to_dtype_4 = torch.ops.aten.to.dtype(fc2_bias, torch.bfloat16)
linear_1 = cast_weight_linear(relu, fc2_weight, to_dtype_4, torch.bfloat16)
to_dtype_5 = torch.ops.aten.to.dtype(linear_1, torch.float32)"""


def ops_of(code: str) -> str:
    """The op lines of graph code, without the `; x = None` frees."""
    lines = [line.strip().split(";")[0] for line in code.splitlines()]
    lines = [line.replace("retarget_execution_autocast_", "") for line in lines]
    return "\n".join(line for line in lines if "torch.ops.aten" in line or "_linear(" in line)


def test_golden_casts_around_a_small_region():
    _, compiled = stack(MLPBlock)
    assert ops_of(compiled.graphs("insert_autocast")["blocks.*"]) == GOLDEN_MLP
    before = ops_of(compiled.graphs("insert_autocast", when="before")["blocks.*"])
    assert "to.dtype" not in before
    (note,) = autocast_record(compiled).notes
    assert note == "blocks.*: graph form; 2 ops in bfloat16 (linear x2); fp32 islands: none"


def test_report_lists_lowered_ops_and_islands_per_region():
    _, compiled = compiled_zoo("tiny_llama")
    record = autocast_record(compiled)
    entry = record.stats["regions"]["model.layers.*"]
    assert entry["form"] == "graph"
    assert entry["lowered_ops"] == {"linear": 7, "scaled_dot_product_attention": 1}
    assert entry["islands"] == {"norm:pow": 2, "norm:mean": 2, "norm:add": 2, "norm:rsqrt": 2}
    assert entry["casts"] > 0
    assert record.stats["dtype"] == "bfloat16"
    assert "insert_autocast" in str(compiled.report)


def test_dynamo_graphs_are_rewritten_by_the_same_tables():
    entry = ZOO["control_flow_model"]
    model = entry.factory()
    compiled = retarget.compile_for(
        model, "bf16", example_inputs=entry.inputs(2), frontends=("dynamo",)
    )
    (region,) = compiled.program.regions
    assert region.frontend == "dynamo"
    assert autocast_record(compiled).stats["regions"]["blocks.*"]["lowered_ops"] == {"linear": 2}
    recorder = DtypeRecorder()
    with recorder:  # grad on: the signature compile_for captured
        out = compiled.blocks[0](torch.randn(2, 16))
    assert recorder.dtypes_of("mm", "addmm") == {torch.bfloat16} and out.dtype == torch.float32
    json.dumps(compiled.report.to_dict())


def test_rewriting_a_graph_again_changes_nothing():
    _, compiled = stack(AttentionBlock)
    gm = compiled.program.regions[0].representative().gm
    code = gm.code
    rewrite_graph(gm, options=AutocastOptions())
    assert gm.code == code


# -- no-op, invariants, bad input ---------------------------------------------------------------
def test_a_model_without_matmuls_is_left_untouched():
    model = nn.Sequential(nn.ReLU())
    x = torch.randn(3, 4)
    for target in ("bf16", "fp16"):
        compiled = retarget.compile_for(model, target, example_inputs=x)
        record = autocast_record(compiled)
        assert record.changed is False
        assert "nothing runs in" in record.notes[0]
        assert compiled.program.plan.loss_scaler is None
        assert "to.dtype" not in compiled.graphs()["<model>"]
        assert torch.equal(compiled(x), model(x))


def test_state_dict_keys_parameters_and_the_original_model_are_unchanged():
    model, compiled = compiled_zoo("tiny_llama")
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for (_, a), (_, b) in zip(model.named_parameters(), compiled.named_parameters(), strict=True):
        assert a is b
    assert all(original_class(m) is type(m) for m in model.modules())
    assert type(compiled.lm_head).__name__ == "RetargetedLinear"
    assert record_of(compiled.lm_head).autocast is not None
    assert type(model.lm_head) is nn.Linear


def test_bad_options_are_refused_with_the_field_and_the_choices():
    with pytest.raises(ValueError, match="keep_fp32 has unknown island kind 'softmx'"):
        AutocastOptions(keep_fp32=("softmx",))
    with pytest.raises(ValueError, match="dtype must be one of"):
        AutocastOptions(dtype="fp8")
    with pytest.raises(TargetError, match="keep_fp32"):
        retarget.compile_for(MLPBlock(), "bf16[keep_fp32=bogus]")


def test_a_graph_that_calls_linear_modules_runs_them_under_autocast():
    # fx graphs call leaf modules; so do regions after swap_fp8 routes Linears to modules.
    gm = torch.fx.symbolic_trace(MLPBlock())
    rewrite_graph(gm, options=AutocastOptions())
    assert record_of(gm.fc1).autocast is not None and gm.meta["autocast"]["lowered"] == 2
    recorder = DtypeRecorder()
    with recorder:  # grad on: the signature compile_for captured
        out = gm(torch.randn(2, 8))
    assert recorder.dtypes_of("mm", "addmm") == {torch.bfloat16}
    assert out.dtype == torch.float32


def test_bf16_with_fp8_leaves_fp8_linears_alone_and_runs_the_kept_ones_in_bf16():
    entry = ZOO["tiny_llama"]
    model = entry.factory()
    target = "bf16+fp8[backend=native,min_size=0,scaling=current]"
    compiled = retarget.compile_for(model, target, example_inputs=entry.inputs(2))
    linears = {p: m for p, m in compiled.named_modules() if isinstance(m, nn.Linear)}
    fp8 = {p for p, m in linears.items() if getattr(m, "_retarget_fp8", False)}
    autocast = {p for p, m in linears.items() if record_of(m).autocast is not None}
    assert fp8 and not fp8 & autocast
    assert autocast == set(linears) - fp8  # kept Linears: glue lm_head and routed region calls
    kept = compiled.get_submodule(sorted(autocast - {"lm_head"})[0])
    recorder = DtypeRecorder()
    with recorder:  # grad on: the signature compile_for captured
        out = kept(torch.randn(2, kept.in_features))
    assert recorder.dtypes_of("mm", "addmm") == {torch.bfloat16} and out.dtype == torch.float32
    loss, _ = step(model, entry.inputs(2), backward=False)
    loss_mixed, _ = step(compiled, entry.inputs(2), backward=False)
    assert abs(loss_mixed - loss).item() < 0.05


def test_no_low_precision_copy_of_a_weight_is_kept_for_backward():
    """The graph form casts a float32 weight to bf16 for its matmul; that cast, saved for the
    input's gradient, would keep a bf16 copy of every weight from forward to backward (with
    LoRA's frozen base: the model's size). cast_weight_linear saves the float32 parameter and
    casts again in backward; the gradients stay within bf16 tolerance of float32."""
    entry = ZOO["tiny_llama"]
    model = entry.factory()
    for name, param in model.named_parameters():
        param.requires_grad_("embed" in name)  # frozen weights; the input still needs grad
    inputs = entry.inputs(2)
    compiled = retarget.compile_for(model, "bf16", example_inputs=inputs)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    shapes |= {shape[::-1] for shape in shapes}
    kept = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in shapes:
            kept.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(call(compiled, inputs))
    loss.backward()
    assert kept == []
    record = autocast_record(compiled).stats["regions"]["model.layers.*"]
    assert record["recast"] == 7  # every Linear of the block
    reference = entry.factory()
    for name, param in reference.named_parameters():
        param.requires_grad_("embed" in name)
    loss_of(call(reference, inputs)).backward()
    (name,) = [n for n, p in compiled.named_parameters() if p.requires_grad]
    got, want = dict(compiled.named_parameters())[name].grad, reference.get_parameter(name).grad
    assert 0 < (got - want).norm() / want.norm() <= GRAD_RTOL_DEFAULT
