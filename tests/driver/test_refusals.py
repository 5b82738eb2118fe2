"""Refusal messages never send the user to another refused target: every target a message
suggests (for each part alone and beside every other, the Accelerator's arguments and
Accelerate's config files) parses and build_pipeline accepts it; and no part lacks a pass.

The refused parts are found by asking build_pipeline (none today), so the test follows when a
part is added before its pass. A suggestion is what follows "use", "e.g.", "did you mean" or
"needs one of" in a message.
"""

from __future__ import annotations

import re

import pytest

from retarget.compat.accelerate.arguments import refuse_unsupported
from retarget.compat.accelerate.config_yaml import read_accelerate_config
from retarget.compat.accelerate.kwargs_handlers import KwargsHandlerError
from retarget.core.errors import TargetNotSupportedError
from retarget.passes.pipeline import build_pipeline
from retarget.targets.grammar import TargetError, parse_target
from retarget.targets.schema import PARTS

SUGGESTION = re.compile(
    r"(?:\buse|\be\.g\.|did you mean|needs one of)\s+"
    r"(?:target=)?('[^']+'(?:,\s*'[^']+')*|[A-Za-z0-9_+\-\[\]=,.]*[A-Za-z0-9\]])"
)
#: "no pass implements 'tp'" and "no pass implements tensor parallelism ('tp')".
NOT_IMPLEMENTED = re.compile(r"no pass implements [^;']*'([a-z0-9-]+)'")
#: Accelerator arguments and accelerate config files whose refusals are about a refused part.
ACCELERATOR_ARGUMENTS = ("megatron_lm_plugin",)
ACCELERATE_CONFIGS = (
    "distributed_type: MEGATRON_LM\n",
    "distributed_type: NO\nparallelism_config:\n  dp_shard_size: 2\n",
    "distributed_type: MULTI_GPU\nmixed_precision: bf16\ndowncast_bf16: 'yes'\n",
)


def refusal(spec: str) -> str | None:
    """The message that refuses `spec` (at parse or in build_pipeline), None if accepted."""
    try:
        build_pipeline(parse_target(spec))
    except (TargetError, TargetNotSupportedError) as err:
        return str(err)
    return None


def refused_by_pipeline(name: str) -> bool:
    """A part that parses on its own but that no pass implements (not one whose pass needs a
    package this environment lacks, as xla without torch_xla)."""
    try:
        build_pipeline(parse_target(name))
    except TargetNotSupportedError as error:
        return "no pass implements" in str(error)
    except TargetError:
        return False
    return False


REFUSED = [name for name in PARTS if refused_by_pipeline(name)]


def suggestions(message: str) -> list[str]:
    """The targets `message` suggests, lower-cased (accelerate configs say FSDP for fsdp)."""
    found = []
    for match in SUGGESTION.finditer(message):
        quoted = re.findall(r"'([^']+)'", match.group(1))
        found += quoted or [match.group(1)]
    return [s.lower() for s in found]


def messages_about(part: str) -> list[str]:
    """Every refusal of a target that holds `part` with at most one other part, and of the
    options, Accelerator arguments and config files that lead to `part`."""
    specs = [part, *(f"{part}+{other}" for other in PARTS if other != part)]
    found = [m for m in map(refusal, specs) if m is not None]
    found.append(refusal("bf16[downcast=true]"))  # the option that needs xla
    return found


def accelerate_messages(tmp_path) -> list[str]:
    found = []
    for name in ACCELERATOR_ARGUMENTS:
        with pytest.raises(KwargsHandlerError) as info:
            refuse_unsupported(**{name: object()})
        found.append(str(info.value))
    for index, text in enumerate(ACCELERATE_CONFIGS):
        path = tmp_path / f"config{index}.yaml"
        path.write_text(text)
        with pytest.raises(TargetError) as info:
            read_accelerate_config(path)
        found.append(str(info.value))
    return found


def test_no_part_is_refused():
    # compile has its pass (compile_regions) since issue 18, xla (place_xla) since issue 16,
    # tp (shard_tp) since issue 12.
    assert set(REFUSED) == set()
    assert refusal("bf16+ac+compile[backend=aot_eager]") is None


def test_suggestions_are_read_from_every_form_the_messages_use():
    assert suggestions("pick one; use 'fsdp' or not") == ["fsdp"]
    assert suggestions("write the target, e.g. target='hsdp'") == ["hsdp"]
    assert suggestions("needs one of 'ddp', 'zero1': hooks") == ["ddp", "zero1"]
    assert suggestions("cannot be honoured; use FSDP") == ["fsdp"]
    assert suggestions("do not combine; use bf16+fp8") == ["bf16+fp8"]
    assert suggestions("no pass implements 'tp' yet") == []


@pytest.mark.parametrize("part", sorted(PARTS))
def test_refusals_suggest_only_accepted_targets(part):
    """Every refusal of `part` with at most one other part (conflicts, options that need
    another part, ...) suggests only targets that are accepted."""
    messages = messages_about(part)
    for message in messages:
        for suggested in suggestions(message):
            assert refusal(suggested) is None, f"{message!r} suggests refused {suggested!r}"


def test_accelerate_refusals_suggest_only_accepted_targets(tmp_path):
    for message in accelerate_messages(tmp_path):
        for suggested in suggestions(message):
            assert refusal(suggested) is None, f"{message!r} suggests refused {suggested!r}"


def test_not_implemented_is_said_only_of_refused_parts(tmp_path):
    messages = [m for part in REFUSED for m in messages_about(part)]
    named = {
        n for m in messages + accelerate_messages(tmp_path) for n in NOT_IMPLEMENTED.findall(m)
    }
    assert named == set(REFUSED)
