"""The HF zoo at default configs: every repeated block captured, bit for bit equal to eager.

Each model keeps its default config (use_cache on, dropout on) with only the sizes shrunk
(retarget.models.hf_zoo). "single" must reproduce the original model exactly: loss, logits, every
gradient and the returned KV cache, in train and eval mode; generate() must give the same tokens
(under "bf16" the tokens of the original run inside torch.autocast(bfloat16)).
"""

from __future__ import annotations

import pytest
import torch

from retarget.core.errors import EagerRegionWarning
from retarget.driver.compile import compile_for
from retarget.frontends.state_layout import layout
from retarget.models.hf_zoo import GENERATING, HF_ZOO, hf_model

pytest.importorskip("transformers")


def _same_cache(want, got) -> None:
    assert (want is None) == (got is None)
    if want is None:
        return
    (want_skeleton, want_tensors), (got_skeleton, got_tensors) = layout([want]), layout([got])
    assert want_skeleton == got_skeleton
    assert len(want_tensors) == len(got_tensors)
    for index, (a, b) in enumerate(zip(want_tensors, got_tensors, strict=True)):
        assert torch.equal(a, b), f"cache tensor {index}"


def _forward(model, inputs, seed: int = 1):
    torch.manual_seed(seed)  # dropout draws the same masks in both models
    return model(**inputs)


def _assert_captured(compiled, entry) -> None:
    regions = compiled.program.regions
    eager = [r.name for r in regions if r.eager_only or r.eager_keys]
    assert not eager, [(r.name, r.reason) for r in regions if r.name in eager]
    assert all(r.frontend in ("export", "fx", "dynamo") for r in regions)
    assert set(entry.blocks) <= {r.block_type for r in regions}


@pytest.mark.parametrize("name", list(HF_ZOO))
def test_default_config_is_captured_and_bitwise(name: str) -> None:
    entry = hf_model(name)
    reference, model = entry.factory(), entry.factory()
    inputs = entry.inputs()
    compiled = compile_for(model, "single", example_inputs=inputs)
    _assert_captured(compiled, entry)

    want, got = _forward(reference, inputs), _forward(compiled, inputs)
    assert torch.equal(want.loss, got.loss)
    assert torch.equal(want.logits, got.logits)
    _same_cache(getattr(want, "past_key_values", None), getattr(got, "past_key_values", None))
    want.loss.backward()
    got.loss.backward()
    for (path, a), b in zip(reference.named_parameters(), compiled.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), path
        assert a.grad is None or torch.equal(a.grad, b.grad), path

    reference.eval()
    compiled.eval()
    for grad in (True, False):  # grad mode is part of the signature: both are captured
        with torch.set_grad_enabled(grad):
            want, got = _forward(reference, inputs), _forward(compiled, inputs)
        assert torch.equal(want.logits, got.logits)
        _same_cache(getattr(want, "past_key_values", None), getattr(got, "past_key_values", None))
    _assert_captured(compiled, entry)
    _hooks_fire_as_in_eager(reference, compiled, inputs)


def _hooks_fire_as_in_eager(reference, compiled, inputs) -> None:
    """A forward hook inside the first region sees what it sees in eager, call for call."""
    region = compiled.program.regions[0]
    path = next(
        f"{region.paths[0]}.{name}".lstrip(".")
        for name, module in compiled.get_submodule(region.paths[0]).named_modules()
        if name and not list(module.children()) and list(module.parameters())
    )
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "compiled": []}
    handles = []
    for tag, root in (("eager", reference), ("compiled", compiled)):

        def hook(module, args, output, tag=tag):
            seen[tag].append(output.detach().clone())

        handles.append(root.get_submodule(path).register_forward_hook(hook))
    with pytest.warns(EagerRegionWarning, match=path.split(".")[-1]):
        want, got = _forward(reference, inputs), _forward(compiled, inputs)
    for handle in handles:
        handle.remove()
    assert torch.equal(want.logits, got.logits)
    assert len(seen["compiled"]) == len(seen["eager"]) >= 1, path
    assert all(map(torch.equal, seen["eager"], seen["compiled"]))
    assert path.removeprefix(region.paths[0] + ".") in region.hooked


#: bf16 is checked on the models the issue names; retarget's bf16 keeps fp32 islands (norms,
#: softmax, loss) that plain autocast does not, so on other random-weight models a greedy argmax
#: may flip late in a sequence (gemma2: token 10 of 16) without either being wrong.
BF16_GENERATING = ["llama", "gpt2", "qwen2", "qwen3", "t5", "bart"]
CASES = [(name, "single") for name in GENERATING] + [(n, "bf16") for n in BF16_GENERATING]


@pytest.mark.parametrize(("name", "precision"), CASES)
def test_generate_gives_the_original_tokens(name: str, precision: str) -> None:
    entry = hf_model(name)
    reference, model = entry.factory().eval(), entry.factory().eval()
    compiled = compile_for(model, precision, example_inputs=entry.inputs()).eval()
    prompt = entry.prompt()
    # max_new_tokens > the zoo's sliding window: sliding caches wrap during the test.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        want = reference.generate(prompt, max_new_tokens=16, do_sample=False)
    got = compiled.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(want, got)
    _assert_captured(compiled, entry)
