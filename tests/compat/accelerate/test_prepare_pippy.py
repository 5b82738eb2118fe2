"""`retarget.inference.prepare_pippy` (Accelerate's `accelerate.inference.prepare_pippy`):
pipeline-parallel inference, 2 gloo ranks against one process's forward.

- GPT-2 (default config, sizes shrunk; positional `input_ids`) and BERT for sequence
  classification (keyword inputs with an attention mask), split where the pp planner balances
  them ("auto"), 2 microbatches: the last rank's output equals one process's (within float32
  rounding), the others get None, or every rank the output with gather_output=True; a list of
  split points is used as given.
- One process: nothing to pipeline (the model comes back as it is), and the refusals, each
  naming the value.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from retarget.inference import prepare_pippy
from tests.distributed import run_ranks

VOCAB, SEQ, ROWS = 64, 16, 4


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=SEQ)
    return GPT2LMHeadModel(config).eval()


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=SEQ,
    )  # fmt: skip
    return BertForSequenceClassification(config).eval()


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def _first(output: Any) -> torch.Tensor:
    """The first tensor of a model's output (logits), whatever container holds it."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return next(iter(output.values()))
    return _first(output[0])


def _inference(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with torch.no_grad():
        example = ids()
        expected = gpt2()(example).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = prepare_pippy(gpt2(), example_args=(example,), num_chunks=2)
        got = model(ids())
        out["gpt2"] = {
            "warned": any("use_cache set to False" in str(w.message) for w in caught),
            "points": model.hf_split_points,
            "error": None if got is None else float((_first(got) - expected).abs().max()),
        }
        mask = torch.ones(ROWS, SEQ, dtype=torch.long)
        mask[:, -3:] = 0  # padding at the end of every row
        inputs = {"input_ids": ids(1), "attention_mask": mask}
        expected = bert()(**inputs).logits
        model = prepare_pippy(
            bert(), split_points=["bert.encoder.layer.2"], example_kwargs=inputs,
            gather_output=True,
        )  # fmt: skip
        got = model(**inputs)
        out["bert"] = {"error": float((_first(got) - expected).abs().max())}
        try:
            model(**{k: v[:2] for k, v in inputs.items()})
            out["refused"] = ""
        except ValueError as error:
            out["refused"] = str(error)
    return out


@pytest.mark.distributed
def test_two_ranks_give_one_process_outputs():
    first, last = run_ranks(_inference, 2, timeout=300)
    assert first["gpt2"]["points"] == last["gpt2"]["points"]
    (point,) = first["gpt2"]["points"]
    assert point.startswith("transformer.h.")  # the planner cut at (or inside) a block
    assert first["gpt2"]["warned"] and last["gpt2"]["warned"]  # its cache was turned off
    assert first["gpt2"]["error"] is None  # Accelerate: the output is the last process's
    assert last["gpt2"]["error"] < 1e-5
    for rank in (first, last):  # gather_output: every process has it
        assert rank["bert"]["error"] < 1e-5
        assert "a call with 2 rows" in rank["refused"] and "4" in rank["refused"]


def test_one_process_has_nothing_to_pipeline():
    model = gpt2()
    forward = model.forward
    assert prepare_pippy(model, example_args=(ids(),)) is model
    assert model.forward == forward and model.hf_split_points == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"example_args": (ids(),), "num_chunks": 3}, r"num_chunks=3 does not divide .* 4 rows"),
        ({"example_args": ()}, r"no tensor in example_args / example_kwargs"),
        ({"example_args": (ids(),), "split_points": ["transformer.h.9"]},
         r"split_points \['transformer.h.9'\] are not modules of GPT2LMHeadModel"),
    ],
)  # fmt: skip
def test_refusals_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prepare_pippy(gpt2(), **kwargs)
