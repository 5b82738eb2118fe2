"""pp (pipeline parallelism) against one process, for transformers causal LMs at their default
configs (sizes shrunk, dropout off).

- 2 gloo ranks, schedules gpipe and 1f1b on a 4-layer Llama (GQA), Qwen2 with its head tied to
  the embedding and GPT-2 (tied, learned positions): the loss every rank gets
  from `runtime.forward_backward` equals one process's within 1e-5 relative, every parameter's
  gradient lives on exactly one rank and equals one process's within 1e-5 relative (of its
  largest entry), every unflattened module of a stage runs its generated code (not fx's
  Interpreter); 20 SGD steps track one process's losses within 1e-4; a plain call is refused
  naming forward_backward and unwrap(); the loader is not divided (every stage reads the batch);
  save_state / load_state resume bit for bit (each stage saves its own part) and save_model
  writes every stage's trained tensors.
- 4 gloo ranks, both schedules, a 5-layer Llama: the same agreement (the rotary cos/sin and
  mask made before the blocks reach every stage through the stages in between; one stage
  begins between a block's attention and its MLP).
- 4 gloo ranks fsdp+pp[size=2] ((pp, dp) = (2, 2)): Llama, tied Qwen2 and GPT-2 against one
  process on the whole batch, 20 clipped steps with unwrap(), the tied model's checkpoint
  resumed bitwise, Accelerate's rank members; each rank keeps its stage's weights only.
- pp+ac, pp+bf16+ac and both compiled (aot_eager) on 2 ranks, and beside fsdp on 4: ac
  computes what pp computes (1e-5 of one process) keeping under half the activations saved
  for backward; bf16 within the precision tests' bf16 tolerances of one float32 process, and
  not equal to it; compile compiles one graph per block of the rank's stage.
- As a user runs it: one script (tests/scripts/pp_train_lm.py) on a saved default-config Llama,
  `--target single` in one process and `--target pp` under `retarget launch` on 2: the same
  losses, eval loss and saved weights.
- One process: the stage plan for 4 ranks (balanced by FLOPs, the head on the last stage),
  inspect's text, the exact balancing, refusals naming the value.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import retarget
from retarget.core.errors import TargetNotSupportedError
from retarget.passes.shard.stage_cuts import IMBALANCE_GOAL, balance, cut_units, module_stages
from retarget.targets.errors import TargetError
from tests import zoo
from tests.distributed import run_ranks

SEQ, ROWS = 16, 4


def _decoder(family: str, layers: int, tied: bool) -> torch.nn.Module:
    """A transformers decoder of `family` ("llama" or "qwen2") at its defaults, sizes shrunk
    (GQA: 4 heads, 2 key/value heads)."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=zoo.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return model_class(config).train()


def llama(layers: int = 4, tied: bool = False) -> torch.nn.Module:
    return _decoder("llama", layers, tied)


def qwen2_tied() -> torch.nn.Module:
    """Qwen2 with its LM head tied to the embedding: the weight sits on the first and the last
    stage."""
    return _decoder("qwen2", 4, tied=True)


def gpt2() -> torch.nn.Module:
    """GPT-2 at its defaults (tied head, learned positions), dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=zoo.VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=zoo.VOCAB - 1,
        eos_token_id=zoo.VOCAB - 1,
    )
    return GPT2LMHeadModel(config).train()


MODELS = {"llama": llama, "qwen2_tied": qwen2_tied, "gpt2": gpt2}


def llama8() -> torch.nn.Module:
    """For `retarget inspect tests.passes.shard.test_pipeline_parallel:llama8`."""
    return llama(8)


def batch(seed: int = 1, rows: int = ROWS) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, zoo.VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def mine(data: dict[str, torch.Tensor], compiled: Any) -> dict[str, torch.Tensor]:
    """This rank's rows of a batch: its data-parallel share (pp alone: the whole batch)."""
    rank, size = compiled.runtime.data_parallel_rank, compiled.runtime.data_parallel_size
    return {k: v.chunk(size)[rank] for k, v in data.items()}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as one process holds it (fsdp+pp's DTensor shards gathered over dp)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage a model keeps on this rank (DTensors: their shards)."""
    storages = {}
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def gradient_errors(compiled: Any, reference: torch.nn.Module) -> dict[str, float]:
    """Per parameter with a gradient on this rank: its error relative to one process's."""
    grads = dict(reference.named_parameters())
    return {
        name: float((whole(p.grad) - grads[name].grad).abs().max() / grads[name].grad.abs().max())
        for name, p in compiled.named_parameters()
        if p.grad is not None
    }


def _one_step(
    rank: int, world: int, cases: list[tuple[str, str]], base: str = ""
) -> dict[str, Any]:
    """One forward_backward per (model, schedule) against one process on the whole batch;
    each rank's gradients. `base`: a strategy beside pp ("fsdp+": each dp rank its rows)."""
    out = {}
    for name, schedule in cases:
        build = MODELS[name]
        data = batch(rows=ROWS * world // 2 if base else ROWS)
        reference = build()
        expected = reference(**data).loss
        expected.backward()
        target = f"{base}pp[size=2,schedule={schedule}]" if base else f"pp[schedule={schedule}]"
        compiled = retarget.compile_for(build(), target, example_inputs=batch())
        loss = compiled.runtime.forward_backward(mine(data, compiled))
        errors = gradient_errors(compiled, reference)
        dp = compiled.runtime.data_parallel_size
        loss = whole_loss(loss, compiled) if dp > 1 else loss
        try:
            compiled(**data)
            refused = ""
        except RuntimeError as error:
            refused = str(error)
        out[f"{name} {schedule}"] = {
            "loss_error": abs(float(loss) - float(expected)) / abs(float(expected)),
            "errors": errors,
            "refused": refused,
            "data_parallel": (
                compiled.runtime.data_parallel_rank,
                compiled.runtime.data_parallel_size,
            ),
            "wrapped": compiled.program.plan.applied.wrapped,
            "held_fraction": held_bytes(compiled) / held_bytes(build()),
            "interpreted": interpreted(compiled),
        }
    return out


def interpreted(compiled: Any) -> tuple[int, int]:
    """Of the unflattened modules in this rank's stages: how many still run their graph through
    torch.fx.Interpreter, and how many there are (run_generated_code switches them all)."""
    unflattened = [
        sub
        for stage in compiled.runtime.applied.pipeline.stage_modules
        for sub in stage.modules()
        if hasattr(sub, "_run_with_interpreter")
    ]
    return sum(sub._run_with_interpreter for sub in unflattened), len(unflattened)


@pytest.mark.distributed
def test_two_ranks_equal_one_process_for_each_schedule():
    cases = [
        ("llama", "gpipe"),
        ("llama", "1f1b"),
        ("llama", "interleaved-1f1b"),  # 4 stages of one block, two per rank
        ("qwen2_tied", "1f1b"),
        ("qwen2_tied", "interleaved-1f1b"),
        ("llama", "zero-bubble"),
        ("qwen2_tied", "zero-bubble"),
        ("gpt2", "gpipe"),
    ]
    by_rank = run_ranks(_one_step, 2, cases, timeout=300)
    for name, schedule in cases:
        key = f"{name} {schedule}"
        results = [r[key] for r in by_rank]
        held = [set(r["errors"]) for r in results]
        names = {n for n, _ in MODELS[name]().named_parameters()}
        assert held[0] | held[1] == names, key
        # Each gradient on one rank, but a tied head's on both (summed: one process's).
        tied = {"llama": set(), "qwen2_tied": {"model.embed_tokens.weight"}}
        assert held[0] & held[1] == tied.get(name, {"transformer.wte.weight"}), key
        for r in results:
            assert r["loss_error"] < 1e-5, key
            assert max(r["errors"].values()) < 1e-5, (key, r["errors"])
            assert "runtime.forward_backward(batch)" in r["refused"] and "unwrap()" in r["refused"]
            # a rank keeps its stages' weights (about half), not the whole model's
            assert r["held_fraction"] < 0.7, (key, r["held_fraction"])
            assert r["data_parallel"] == (0, 1)
            # every block runs its generated code, none through fx's Interpreter
            assert r["interpreted"][0] == 0 and r["interpreted"][1] > 0, (key, r["interpreted"])
    llama_held = set(by_rank[0]["llama 1f1b"]["errors"])
    assert "model.embed_tokens.weight" in llama_held and "lm_head.weight" not in llama_held


def _saved_bytes_and_step(compiled: Any, data: dict[str, torch.Tensor]) -> tuple[Any, int]:
    """forward_backward's loss, and the bytes autograd saved for backward outside recomputed
    blocks (a checkpointed block's saves go to torch's checkpoint, not to these hooks)."""
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = compiled.runtime.forward_backward(data)
    return loss, saved[0]


#: What runs inside the stages, beside pp (the compiled arms on aot_eager: inductor's C++
#: builds would dominate the test's time).
INSIDE = (
    "",
    "+ac",
    "+bf16+ac",
    "+ac+compile[backend=aot_eager]",
    "+bf16+ac+compile[backend=aot_eager]",
)


def _inside_stages(
    rank: int, world: int, base: str = "", dp: int | None = None, arms: tuple[str, ...] = INSIDE
) -> dict[str, Any]:
    """pp and each of INSIDE (after `base`, "fsdp+": each of the `dp` ranks (world / 2 by
    default) its rows) on one Llama step against one process in float32: the loss error, the
    gradient error (the norm of the differences over the norm of one process's gradients, over
    this rank's parameters), the bytes saved for backward, the graphs dynamo compiled, and the
    plan's description."""
    from torch._dynamo.utils import counters

    dp = (world // 2 if base else 1) if dp is None else dp
    data = batch(rows=ROWS * dp)
    reference = llama()
    expected = reference(**data).loss
    expected.backward()
    grads = dict(reference.named_parameters())
    pp = "pp[size=2]" if base else "pp"
    out = {}
    for parts in arms:
        graphs = counters["stats"]["unique_graphs"]
        compiled = retarget.compile_for(llama(), f"{base}{pp}{parts}", example_inputs=batch())
        loss, saved = _saved_bytes_and_step(compiled, mine(data, compiled))
        loss = whole_loss(loss, compiled) if dp > 1 else loss
        held = [
            (whole(p.grad), grads[n].grad)
            for n, p in compiled.named_parameters()
            if p.grad is not None
        ]
        difference = sum(float((a - b).square().sum()) for a, b in held) ** 0.5
        norm = sum(float(b.square().sum()) for _, b in held) ** 0.5
        out[parts] = {
            "loss_error": abs(float(loss) - float(expected)),
            "grad_error": difference / norm,
            "saved": saved,
            "graphs": counters["stats"]["unique_graphs"] - graphs,
            "blocks": len(
                compiled.program.plan.pp.stages_of(compiled.runtime.applied.pipeline.rank)[0].blocks
            ),
            "plan": compiled.program.plan.pp.describe(),
            "passes": [record.name for record in compiled.history],
        }
    return out


def assert_inside_stages(results: dict[str, Any]) -> None:
    """pp+ac computes what pp computes, keeping far fewer activations, and so does it compiled;
    pp+bf16+ac, compiled or not, stays within the bf16 tolerances the precision tests use and
    differs from float32 (bf16 ran); each compiled arm compiled a graph per block of the
    rank's stage, and nothing else compiled."""
    from tests.passes.precision.test_insert_autocast import GRAD_RTOL_DEFAULT, LOSS_ATOL

    plain = results[""]
    for parts, r in results.items():
        if "bf16" in parts:
            assert r["loss_error"] <= LOSS_ATOL, (parts, r)
            assert 1e-5 < r["grad_error"] <= GRAD_RTOL_DEFAULT, (parts, r)
            assert "each stage under torch.autocast(bfloat16)" in r["plan"]
        else:
            assert r["loss_error"] < 1e-5 and r["grad_error"] < 1e-5, (parts, r)
        if "+ac" in parts:
            assert "every block recomputed in backward" in r["plan"]
        if "compile" in parts:
            assert r["graphs"] == r["blocks"], (parts, r)
            assert "each block compiled (torch.compile backend=aot_eager)" in r["plan"]
        else:
            assert r["graphs"] == 0, (parts, r)
        if parts in ("+ac", "+bf16+ac"):
            assert r["saved"] < 0.5 * plain["saved"], (parts, r["saved"], plain["saved"])
        # the region-graph passes stand aside: the stages, not the region graphs, run
        assert not {"insert_autocast", "checkpoint_blocks", "compile_regions"} & set(r["passes"])


@pytest.mark.distributed
def test_bf16_ac_and_compile_run_inside_the_stages_on_two_ranks():
    for results in run_ranks(_inside_stages, 2, timeout=300):
        assert_inside_stages(results)


def whole_loss(loss: torch.Tensor, compiled: Any) -> torch.Tensor:
    """The mean of the dp ranks' losses (each rank's is its own rows' mean)."""
    import torch.distributed as dist

    mesh = compiled.runtime.applied.mesh
    loss = loss.clone()
    dist.all_reduce(loss, group=mesh["dp"].get_group())
    return loss / mesh["dp"].size()


def _training(rank: int, world: int, steps: int, target: str = "pp") -> dict[str, list[float]]:
    """SGD steps clipped to a norm of 1 (the stages' norms combined into the whole model's)."""
    reference = llama()
    compiled = retarget.compile_for(llama(), target, example_inputs=batch())
    dp = compiled.runtime.data_parallel_size
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    out: dict[str, list[float]] = {"ours": [], "theirs": [], "norms": [], "ref_norms": []}
    for step in range(steps):
        data = batch(seed=100 + step % 2, rows=ROWS * dp)  # two batches in turn: the loss falls
        loss = reference(**data).loss
        loss.backward()
        out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)))
        ref_opt.step()
        ref_opt.zero_grad()
        out["theirs"].append(float(loss))
        ours = compiled.runtime.forward_backward(mine(data, compiled))
        out["ours"].append(float(whole_loss(ours, compiled) if dp > 1 else ours))
        out["norms"].append(float(compiled.runtime.clip_grad_norm_(compiled.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    # unwrap(): every rank gets every stage's trained weights; an eval forward equals one
    # process's.
    model = compiled.unwrap().eval()
    data = batch(seed=5)
    with torch.no_grad():
        out["eval"] = [float(model(**data).loss), float(reference.eval()(**data).loss)]
    return out


def assert_training(training: dict[str, Any]) -> None:
    """`_training`'s steps track one process's losses and norms within 1e-4 (the loss falls and
    clipping was active); the unwrapped model's eval loss too."""
    ours, theirs = training["ours"], training["theirs"]
    assert theirs[-1] < theirs[0]
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(ours, theirs, strict=True))
    assert abs(training["eval"][0] - training["eval"][1]) <= 1e-4 * training["eval"][1]
    assert max(training["ref_norms"]) > 1.0
    assert all(
        abs(a - b) <= 1e-4 * b
        for a, b in zip(training["norms"], training["ref_norms"], strict=True)
    )


def _checkpoint(
    rank: int, world: int, folder: str, name: str, target: str = "pp"
) -> dict[str, Any]:
    """Adam for 3 steps, save_state and save_model, 2 more steps; a fresh pipelined model
    loaded from the checkpoint takes the same 2 steps bit for bit. The saved model's tensors
    equal the live ones of the stage that trained them."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from retarget.runtime.state.checkpoint import load_state, save_state
    from retarget.runtime.state.save_model import save_model

    def fresh() -> tuple[Any, Any]:
        compiled = retarget.compile_for(MODELS[name](), target, example_inputs=batch())
        return compiled, torch.optim.Adam(compiled.parameters(), lr=1e-3)

    def steps(compiled: Any, optimizer: Any, seeds: range) -> None:
        dp = compiled.runtime.data_parallel_size
        for seed in seeds:
            compiled.runtime.forward_backward(mine(batch(seed=seed, rows=ROWS * dp), compiled))
            optimizer.step()
            optimizer.zero_grad()

    def everything(compiled: Any) -> dict[str, torch.Tensor]:
        return {k: whole(v).detach().clone() for k, v in compiled.state_dict().items()}

    compiled, optimizer = fresh()
    steps(compiled, optimizer, range(3))
    save_state(f"{folder}/state", model=compiled, optimizers=optimizer)
    save_model(compiled, f"{folder}/model")
    dist.barrier()
    written = load_file(f"{folder}/model/model.safetensors")
    live = everything(compiled)
    held = compiled.runtime.applied.pipeline.held_keys(compiled)  # what this rank's stage trains
    saved_equal = all(torch.equal(written[k], live[k]) for k in held & written.keys())
    steps(compiled, optimizer, range(3, 5))
    expected = everything(compiled)
    resumed, resumed_optimizer = fresh()
    load_state(f"{folder}/state", model=resumed, optimizers=resumed_optimizer)
    steps(resumed, resumed_optimizer, range(3, 5))
    got = everything(resumed)
    return {
        # this rank's stages' tensors (the others are emptied here)
        "bitwise": list(got) == list(expected)
        and all(torch.equal(got[k], expected[k]) for k in held),
        "saved_equal": saved_equal,
        "held": sorted(held),
        "written": sorted(written),
        "changed": sorted(
            k
            for k in held & written.keys()
            if not torch.equal(written[k], MODELS[name]().state_dict()[k])
        ),
    }


def _accumulated(rank: int, world: int) -> dict[str, Any]:
    """accumulate(2) around forward_backward: the window's gradients are the mean of its two
    batches' (one process: the two losses averaged); the first micro-step's optimizer step
    changes nothing (its gradients are held back)."""
    reference = llama()
    batches = [batch(seed=7), batch(seed=8)]
    ((reference(**batches[0]).loss + reference(**batches[1]).loss) / 2).backward()
    compiled = retarget.compile_for(llama(), "pp", example_inputs=batch())
    run = compiled.runtime
    optimizer = run.prepare(torch.optim.SGD(compiled.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in compiled.state_dict().items()}
    synced = []
    for data in batches:
        with run.accumulate(2):
            run.forward_backward(data)
            synced.append(run.sync_gradients)
            if not run.sync_gradients:
                optimizer.step()
                held = run.applied.pipeline.held_keys(compiled)  # the other stages': emptied
                unchanged = all(
                    torch.equal(v, before[k]) for k, v in compiled.state_dict().items() if k in held
                )
    grads = dict(reference.named_parameters())
    errors = {
        name: float((p.grad - grads[name].grad).abs().max() / grads[name].grad.abs().max())
        for name, p in compiled.named_parameters()
        if p.grad is not None
    }
    return {"errors": errors, "synced": synced, "unchanged": unchanged}


def _training_and_resume(rank: int, world: int, steps: int, folder: str) -> dict[str, Any]:
    return {
        "accumulated": _accumulated(rank, world),
        "training": _training(rank, world, steps),
        "checkpoint": _checkpoint(rank, world, f"{folder}/llama", "llama"),
        "tied": _checkpoint(rank, world, f"{folder}/qwen2", "qwen2_tied"),
    }


@pytest.mark.distributed
def test_steps_accumulation_and_a_checkpoint_resume_bitwise(tmp_path):
    results = run_ranks(_training_and_resume, 2, 20, str(tmp_path), timeout=300)
    for training in (r["training"] for r in results):
        ours, theirs = training["ours"], training["theirs"]
        assert theirs[-1] < theirs[0]
        for a, b in zip(ours, theirs, strict=True):
            assert abs(a - b) <= 1e-4 * abs(b)
        ours_eval, theirs_eval = training["eval"]
        assert abs(ours_eval - theirs_eval) <= 1e-4 * theirs_eval, training["eval"]
        # Every stage got the whole model's norm, and clipping was active (norms above 1).
        assert max(training["ref_norms"]) > 1.0
        for a, b in zip(training["norms"], training["ref_norms"], strict=True):
            assert abs(a - b) <= 1e-4 * b
    for accumulated in (r["accumulated"] for r in results):
        assert accumulated["synced"] == [False, True] and accumulated["unchanged"]
        assert accumulated["errors"] and max(accumulated["errors"].values()) < 1e-5, accumulated
    checkpoints = [r["checkpoint"] for r in results]
    assert all(c["bitwise"] and c["saved_equal"] for c in checkpoints), checkpoints
    # Each stage saved its own part: together every tensor once, all in save_model's file.
    held = [set(c["held"]) for c in checkpoints]
    assert not held[0] & held[1] and held[0] | held[1] == set(checkpoints[0]["written"])
    # The file holds trained weights of both stages, not rank 0's untrained copy of stage 2.
    assert "lm_head.weight" in checkpoints[1]["changed"]
    # A head tied to the embedding: held by both stages, trained alike, saved once.
    tied = [r["tied"] for r in results]
    assert all(c["bitwise"] and c["saved_equal"] for c in tied), tied
    both = set(tied[0]["held"]) & set(tied[1]["held"])
    assert "model.embed_tokens.weight" in both and "model.embed_tokens.weight" in tied[1]["changed"]


def _four_stages(rank: int, world: int) -> dict[str, Any]:
    """4 layers on 4 stages: the rotary cos/sin and mask made before the blocks reach every
    stage forwarded stage by stage (chain_skips); whole blocks would balance poorly (the head
    on the last), so stages begin inside blocks (the plan's cuts=auto): before an attention's
    key projection, its value projection and its output projection, so the query and key as
    attention left them (transposed per head: strided, sent contiguous) cross between ranks,
    in the middle stages as well as from the first."""
    out = {}
    for schedule in ("gpipe", "1f1b"):
        data = batch(rows=8)
        reference = llama(4)
        expected = reference(**data).loss
        expected.backward()
        compiled = retarget.compile_for(llama(4), f"pp[schedule={schedule}]", example_inputs=data)
        loss = compiled.runtime.forward_backward(data)
        grads = dict(reference.named_parameters())
        out[schedule] = {
            "inside_blocks": compiled.program.plan.pp.inside_blocks,
            "split_points": compiled.program.plan.pp.split_points,
            "loss_error": abs(float(loss) - float(expected)) / abs(float(expected)),
            "errors": {
                name: float((p.grad - grads[name].grad).abs().max() / grads[name].grad.abs().max())
                for name, p in compiled.named_parameters()
                if p.grad is not None
            },
        }
    return out


@pytest.mark.distributed
def test_four_stages_equal_one_process():
    by_rank = run_ranks(_four_stages, 4, timeout=400)
    names = {name for name, _ in llama(4).named_parameters()}
    for schedule in ("gpipe", "1f1b"):
        held = [set(r[schedule]["errors"]) for r in by_rank]
        assert set().union(*held) == names and sum(map(len, held)) == len(names), schedule
        for r in by_rank:
            assert r[schedule]["split_points"] == (
                "model.layers.1.self_attn.k_proj", "model.layers.2.self_attn.v_proj",
                "model.layers.3.self_attn.o_proj",
            )  # fmt: skip
            assert r[schedule]["inside_blocks"]  # 4 blocks on 4 stages balance better cut inside
            assert r[schedule]["loss_error"] < 1e-5, schedule
            assert max(r[schedule]["errors"].values()) < 1e-5, schedule


FSDP_PP_CASES = [("llama", "1f1b"), ("qwen2_tied", "interleaved-1f1b"), ("gpt2", "gpipe")]


def _fsdp_pp(rank: int, world: int, folder: str) -> dict[str, Any]:
    """fsdp+pp[size=2] on 4 ranks (a (pp, dp) = (2, 2) mesh): one step per model and schedule,
    20 clipped steps with unwrap(), and a tied model's checkpoint resumed."""
    return {
        "step": _one_step(rank, world, FSDP_PP_CASES, base="fsdp+"),
        "training": _training(rank, world, 20, target="fsdp+pp[size=2]"),
        "tied": _checkpoint(rank, world, f"{folder}/qwen2", "qwen2_tied", "fsdp+pp[size=2]"),
        "accelerator": _accelerator_ranks("fsdp+pp[size=2]"),
        "inside": _inside_stages(rank, world, base="fsdp+"),
    }


def _accelerator_ranks(target: str) -> tuple[int, int]:
    """retarget.Accelerator's (pipeline_parallel_rank, data_parallel_shard_rank)."""
    accelerator = retarget.Accelerator(target=target)
    return accelerator.pipeline_parallel_rank, accelerator.data_parallel_shard_rank


@pytest.mark.distributed
def test_fsdp_pp_on_four_ranks_equals_one_process(tmp_path):
    by_rank = run_ranks(_fsdp_pp, 4, str(tmp_path), timeout=600)
    # ranks (pp, dp): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1)
    for name, schedule in FSDP_PP_CASES:
        key = f"{name} {schedule}"
        results = [r["step"][key] for r in by_rank]
        assert [r["data_parallel"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
        held = [set(r["errors"]) for r in results]
        assert held[0] == held[1] and held[2] == held[3], key  # a stage's dp ranks: its shards
        assert held[0] | held[2] == {n for n, _ in MODELS[name]().named_parameters()}, key
        for r in results:
            assert r["loss_error"] < 1e-5, key
            assert max(r["errors"].values()) < 1e-5, (key, r["errors"])
            assert r["held_fraction"] < 0.4, (key, r["held_fraction"])  # half a stage's
    for r in by_rank:
        assert_training(r["training"])
    tied = [r["tied"] for r in by_rank]
    assert all(c["bitwise"] and c["saved_equal"] for c in tied), tied
    assert "model.embed_tokens.weight" in tied[2]["changed"] and "lm_head.weight" in tied[0]["held"]
    # Accelerate's members: pp is the outermost mesh dim
    assert [r["accelerator"] for r in by_rank] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in by_rank:  # fsdp+pp+ac, fsdp+pp+bf16+ac
        assert_inside_stages(r["inside"])
    wrapped = by_rank[0]["step"]["llama 1f1b"]["wrapped"]
    assert "fully_shard per stage (mesh pp x dp (2, 2))" in wrapped


# -- one process ---------------------------------------------------------------------------


def _largest(costs: list[int], tail: int, runs: list[tuple[int, int]]) -> int:
    assert runs[0][0] == 0 and runs[-1][1] == len(costs)
    assert all(
        a < b and b == c for (a, b), (c, _) in zip(runs, runs[1:] + [(runs[-1][1], 0)], strict=True)
    )
    totals = [sum(costs[a:b]) for a, b in runs]
    totals[-1] += tail
    return max(totals)


def test_balance_is_the_exact_minimax_cut():
    assert balance([1, 1, 1, 1], 0, 2) == [(0, 2), (2, 4)]
    # The head's cost sits on the last stage, which then takes fewer blocks.
    assert balance([4, 4, 4, 4, 4, 4], 6, 2) == [(0, 4), (4, 6)]
    assert balance([1, 9, 1, 1], 0, 2) == [(0, 2), (2, 4)]
    # Against every cut of a small case: nothing has a smaller largest stage.
    import itertools

    costs, tail = [5, 1, 2, 7, 1, 1, 3, 2], 4
    best = min(
        _largest(
            costs, tail, [(a, b) for a, b in zip((0, *cuts), (*cuts, len(costs)), strict=True)]
        )
        for cuts in itertools.combinations(range(1, len(costs)), 3)
    )
    assert _largest(costs, tail, balance(costs, tail, 4)) == best


def test_plan_for_four_ranks_and_inspect(capsys):
    compiled = retarget.compile_for(
        llama(8), "pp[cuts=blocks]", example_inputs=batch(rows=8), world_size=4
    )
    plan = compiled.program.plan.pp
    assert (plan.size, plan.schedule, plan.microbatches, plan.microbatch_rows) == (4, "1f1b", 8, 1)
    blocks = [len(s.blocks) for s in plan.stages]
    assert sum(blocks) == 8 and blocks[-1] <= blocks[0]  # the head weighs on the last stage
    assert plan.split_points[0] == f"model.layers.{blocks[0]}" and not plan.inside_blocks
    assert abs(plan.bubble - 3 / 11) < 1e-9
    from retarget.cli.main import main

    module = "tests.passes.shard.test_pipeline_parallel"
    argv = ["inspect", f"{module}:llama8", "--inputs", f"{module}:batch", "--world-size", "4"]
    assert main([*argv, "--target", "pp[schedule=gpipe,microbatches=2]"]) == 0
    out = capsys.readouterr().out
    assert "pp[size=4] (gpipe, 2 microbatches): 4 stages of" in out
    assert "bubble 60%" in out
    assert plan.tied == ()
    looped = retarget.compile_for(
        llama(8), "pp[schedule=interleaved-1f1b]", example_inputs=batch(rows=8), world_size=2
    ).program.plan.pp
    assert [s.rank for s in looped.stages] == [0, 1, 0, 1] and looped.stages_per_rank == 2
    assert abs(looped.bubble - 1 / (2 * 4 + 1)) < 1e-9  # (p-1) / (K m + p - 1)
    assert "2 stages per rank): 4 stages of" in looped.describe()
    tied = retarget.compile_for(qwen2_tied(), "pp", example_inputs=batch(), world_size=2)
    assert tied.program.plan.pp.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert "model.embed_tokens.weight = lm_head.weight tied (gradients summed)" in str(tied.report)


def test_cut_units_follow_the_call_timeline():
    compiled = retarget.compile_for(llama(2), "single", example_inputs=batch())
    program = compiled.program
    blocks = ["model.layers.0", "model.layers.1"]
    flops = program.analysis.regions["model.layers.*"]["flops_per_repeat"]
    whole = cut_units(program, blocks, 0)
    assert whole == [(b, b, flops) for b in blocks]
    # Children of a block: its attention half, then from the norm before the MLP on.
    halves = cut_units(program, blocks, 1)
    assert [u[0] for u in halves[:2]] == [
        "model.layers.0", "model.layers.0.post_attention_layernorm"
    ]  # fmt: skip
    starts = [u[0] for u in cut_units(program, blocks, None)[:7]]
    assert starts == [
        "model.layers.0", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj", "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp.act_fn", "model.layers.0.mlp.down_proj",
    ]  # fmt: skip
    assert [u[0] for u in cut_units(program, blocks, 2)[:7]] == starts  # all within depth 2
    for depth in (0, 1, 2, None):
        units = cut_units(program, blocks, depth)
        assert sum(cost for _, _, cost in units) == 2 * flops and all(c > 0 for *_, c in units)


def test_stages_begin_inside_blocks_when_whole_blocks_balance_poorly():
    """5 blocks on 4 stages with the head on the last: 1.48 at block boundaries, 1.04 once a
    stage may begin before an attention's output projection or an MLP's activation; what each
    stage runs follows the cuts. 6 blocks on 2 stages balance within IMBALANCE_GOAL whole: no
    cut inside."""
    example = batch(rows=8)
    blocks_only = retarget.compile_for(
        llama(5), "pp[cuts=blocks]", example_inputs=example, world_size=4
    ).program.plan.pp
    compiled = retarget.compile_for(llama(5), "pp", example_inputs=example, world_size=4)
    plan = compiled.program.plan.pp
    assert blocks_only.imbalance > IMBALANCE_GOAL >= plan.imbalance and plan.inside_blocks
    assert plan.split_points[:2] == ("model.layers.1.self_attn.o_proj", "model.layers.2.mlp.act_fn")
    even = retarget.compile_for(llama(6), "pp", example_inputs=example, world_size=2)
    assert even.program.plan.pp.imbalance <= IMBALANCE_GOAL
    assert not even.program.plan.pp.inside_blocks
    assert "cut inside blocks, at model.layers." in plan.describe()
    assert sum(s.cost for s in plan.stages) == sum(s.cost for s in blocks_only.stages)
    where = module_stages(compiled.program, plan)
    for index, stage in enumerate(plan.stages[1:], start=1):
        assert where[stage.start] == index and stage.blocks[0] in stage.start
    # fsdp+pp's units hold what each stage runs: every parameter once (nothing tied here).
    sharded = retarget.compile_for(
        llama(5), "fsdp+pp[size=4]", example_inputs=example, world_size=8
    ).program.plan.fsdp
    assert sum(u.parameters for u in sharded.units) == sum(p.numel() for p in llama(5).parameters())


def test_memory_estimate_is_the_largest_stages_rank():
    """A rank holds its stage's weights (fsdp+pp: its shards of them); the estimate is the
    largest stage's rank's."""
    from retarget.passes.shard.stage_cuts import stage_parameters
    from retarget.report.memory_estimate import estimate_memory

    compiled = retarget.compile_for(
        llama(6), "fsdp+pp[size=4]", example_inputs=batch(rows=8), world_size=8
    )
    program = compiled.program
    stages = stage_parameters(program, program.plan.pp)
    largest = max(sum(p.numel() for p in ps) for ps in stages)
    total = sum(p.numel() for p in llama(6).parameters())
    estimate = estimate_memory(compiled, optimizer="sgd", run=False)
    # float32; dp = 2 shards of each (even-rowed) stage weight
    assert estimate.gradients == 4 * largest // 2
    assert estimate.parameters == 4 * largest // 2 and largest < total / 3
    alone = estimate_memory(
        retarget.compile_for(llama(6), "pp", example_inputs=batch(rows=8), world_size=4),
        optimizer="sgd",
        run=False,
    )
    assert alone.gradients == alone.parameters == 4 * largest


@pytest.mark.parametrize(
    ("build", "target", "world", "message"),
    [
        (llama, "pp[size=8]", 8, r"has 4 repeated blocks \(model.layers.0 \.\.\.\), fewer than"),
        (llama, "pp[microbatches=3]", 2, r"microbatches=3 does not divide the example's 4 rows"),
        (llama, "pp[schedule=interleaved-1f1b,stages_per_rank=1]", 2,
         r"stages_per_rank=1 leaves nothing to interleave"),
        (llama, "pp[stages_per_rank=2]", 2, r"stages_per_rank=2 needs a looped schedule"),
        (llama, "pp[schedule=interleaved-1f1b]", 4, r"fewer than the 8 stages; use fewer ranks"),
        (llama, "pp[size=2]", 4, r"pipeline degree must be at least 2 and the 4 processes"),
        (llama, "fsdp+pp[size=3]", 4, r"at least 2 and a divisor of the 4 processes"),
    ],
)  # fmt: skip
def test_refusals_name_the_value(build, target, world, message):
    with pytest.raises(TargetNotSupportedError, match=message):
        retarget.compile_for(build(), target, example_inputs=batch(), world_size=world)


def test_a_prepared_loader_gives_the_rows_the_stages_were_traced_for():
    """The stages run one batch size: a loader of another is refused when it is prepared (not
    at the step that would fail), and an epoch's short last batch is dropped, with a warning
    saying how many samples each epoch leaves out."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    compiled = retarget.compile_for(llama(), "pp", example_inputs=batch(), world_size=2)
    ids = torch.randint(1, zoo.VOCAB, (10, SEQ), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"incomplete batch of each epoch \(2 samples\)"):
        loader = compiled.runtime.prepare(DataLoader(TensorDataset(ids), batch_size=ROWS))
    assert [len(rows) for (rows,) in loader] == [ROWS, ROWS] and len(loader) == 2
    with pytest.raises(ValueError, match=r"traced for batches of 4 rows .* gives 8 rows"):
        compiled.runtime.prepare(DataLoader(TensorDataset(ids), batch_size=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a multiple of the batch: nothing to drop, no warning
        loader = compiled.runtime.prepare(DataLoader(TensorDataset(ids[:8]), batch_size=ROWS))
    assert [len(rows) for (rows,) in loader] == [ROWS, ROWS]


def test_interleaved_microbatches_must_fill_its_rounds():
    target = "pp[schedule=interleaved-1f1b,microbatches=5]"
    with pytest.raises(TargetNotSupportedError, match=r"microbatches=5 makes 2 rounds .* of 2"):
        retarget.compile_for(llama(), target, example_inputs=batch(rows=10), world_size=2)


def test_pp_combines_with_fsdp_bf16_ac_and_compile_only_so_far():
    with pytest.raises(TargetError, match="'pp' does not combine with 'fp16'"):
        retarget.compile_for(llama(), "fp16+pp", example_inputs=batch(), world_size=2)
    with pytest.raises(TargetError, match="'pp' does not combine with 'fp8'"):
        retarget.compile_for(llama(), "bf16+fp8+pp", example_inputs=batch(), world_size=2)
    with pytest.raises(TargetNotSupportedError, match=r"'compile\[scope=whole\]' with pp"):
        retarget.compile_for(
            llama(), "compile[scope=whole]+pp", example_inputs=batch(), world_size=2
        )
    with pytest.raises(TargetNotSupportedError, match="schedule=zero-bubble splits each backward"):
        retarget.compile_for(
            llama(), "pp[schedule=zero-bubble]+compile", example_inputs=batch(), world_size=2
        )
    with pytest.raises(ValueError, match="backend='nope' is not a registered"):
        retarget.compile_for(
            llama(), "compile[backend=nope]+pp", example_inputs=batch(), world_size=2
        )
    # what only the region-graph passes implement is refused by name
    with pytest.raises(TargetNotSupportedError, match=r"'bf16\[keep_fp32=.*' with pp.*drop"):
        retarget.compile_for(
            llama(), "bf16[keep_fp32=softmax]+pp", example_inputs=batch(), world_size=2
        )
    with pytest.raises(TargetNotSupportedError, match=r"'ac\[policy=selective\]' with pp"):
        retarget.compile_for(
            llama(), "ac[policy=selective]+pp", example_inputs=batch(), world_size=2
        )
    with pytest.raises(TargetError, match="'pp' does not combine with 'ddp'"):
        retarget.compile_for(llama(), "ddp+pp", example_inputs=batch(), world_size=2)
    with pytest.raises(TargetError, match="'pp' does not combine with 'hsdp'"):
        retarget.compile_for(llama(), "hsdp+pp[size=2]", example_inputs=batch(), world_size=4)
    with pytest.raises(TargetNotSupportedError, match="with pp: loading the weights on rank 0"):
        retarget.compile_for(
            llama(), "fsdp[cpu_ram_efficient_loading=true]+pp[size=2]", example_inputs=batch(),
            world_size=4,
        )  # fmt: skip


def test_fsdp_pp_plan_shards_each_stage_over_its_dp_ranks():
    compiled = retarget.compile_for(
        qwen2_tied(), "fsdp+pp[size=2]", example_inputs=batch(), world_size=4
    )
    plan = compiled.program.plan
    assert (plan.pp.size, plan.pp.dp, plan.fsdp.mesh_shape) == (2, 2, (2,))
    assert plan.fsdp.mesh_dims == ("dp",)
    units = plan.fsdp.units
    assert [u.block for u in units] == ["pipeline stage 0", "pipeline stage 1"]
    # the tied embedding / head is in both stages' units
    total = sum(p.numel() for p in qwen2_tied().parameters())
    embedding = qwen2_tied().model.embed_tokens.weight.numel()
    assert sum(u.parameters for u in units) == total + embedding
    text = str(compiled.report)
    assert "each pipeline stage is one fully_shard unit" in text
    assert "each stage on 2 ranks, fsdp over them (mesh pp x dp)" in text


# -- as a user runs it ----------------------------------------------------------------------


def _run_script(args: list[str], tmp_path: Any) -> dict[str, Any]:
    import json
    import subprocess
    import sys

    from tests.paths import REPO, SCRIPTS

    done = subprocess.run(
        [sys.executable, *args[:-1], str(SCRIPTS / "pp_train_lm.py"), *args[-1].split()],
        capture_output=True, text=True, cwd=REPO, timeout=400,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
             "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(part for part in done.stdout.splitlines() if part.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.distributed
def test_a_user_script_trains_alike_with_and_without_pp(tmp_path):
    """The same script (tests/scripts/pp_train_lm.py) on a Llama checkpoint at its default
    config (sizes shrunk): `--target single` in one process and `--target pp` under `retarget
    launch` on 2 processes give the same losses, eval loss and saved weights."""
    from safetensors.torch import load_file

    llama().save_pretrained(tmp_path / "model")
    model = str(tmp_path / "model")
    single = _run_script([f"{model} --target single --out {tmp_path}/single"], tmp_path)
    launch = ["-m", "retarget", "launch", "--num_processes", "2"]
    piped = _run_script([*launch, f"{model} --target pp --out {tmp_path}/pp"], tmp_path)
    for ours, theirs in zip(piped["losses"], single["losses"], strict=True):
        assert abs(ours - theirs) <= 1e-4 * theirs, (piped, single)
    assert abs(piped["eval"] - single["eval"]) <= 1e-4 * single["eval"]
    saved = [load_file(tmp_path / name / "model.safetensors") for name in ("pp", "single")]
    assert saved[0].keys() == saved[1].keys()
    for key, tensor in saved[1].items():
        assert torch.allclose(saved[0][key], tensor, rtol=1e-4, atol=1e-5), key
