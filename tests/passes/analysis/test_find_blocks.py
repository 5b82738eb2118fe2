"""find_blocks: structural hashing and the module tree."""

from __future__ import annotations

from torch import nn

import retarget
from retarget.passes.analysis.find_blocks import fingerprint, module_tree, repeated_blocks
from tests.zoo import ZOO


def test_blocks_of_the_zoo():
    found = {}
    for name, entry in ZOO.items():
        model = entry.factory()
        memo = {}
        found[name] = [(g.block_type, g.paths) for g in repeated_blocks(model, memo, 2)]
    assert found["tiny_llama"] == [("LlamaDecoderLayer", ["model.layers.0", "model.layers.1"])]
    assert found["tiny_gpt2"] == [("GPT2Block", ["transformer.h.0", "transformer.h.1"])]
    assert found["small_cnn"] == [("BasicBlock", ["layer1.0", "layer1.1"])]  # not layer2
    assert found["mnist_cnn"] == []


def test_structure_not_class_decides():
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 5)
    memo = {}
    assert fingerprint(a, memo) == fingerprint(b, memo) != fingerprint(c, memo)
    wide = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    other_p = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2))
    assert fingerprint(wide, memo) != fingerprint(other_p, memo)  # scalar attributes count


def test_position_attributes_do_not_split_blocks():
    def block(i):
        seq = nn.Sequential(nn.Linear(4, 4))
        seq.layer_idx = i
        return seq

    model = nn.Sequential(block(0), block(1), block(2))
    (group,) = repeated_blocks(model, {}, 2)
    assert group.paths == ["0", "1", "2"] and group.name == "*"


def test_only_outermost_repeats_are_blocks():
    inner = lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # noqa: E731
    model = nn.Sequential(nn.Sequential(inner(), inner()), nn.Sequential(inner(), inner()))
    (group,) = repeated_blocks(model, {}, 2)
    assert group.paths == ["0", "1"]


def test_tree_has_every_module_with_classes_and_counts():
    model = ZOO["mnist_cnn"].factory()
    tree = module_tree(model, {})
    assert tree.number_of_nodes() == len(list(model.named_modules()))
    assert tree.nodes["fc1"]["cls"] == "Linear"
    assert tree.nodes["fc1"]["params"] == 9216 * 128 + 128
    assert tree.nodes[""]["total_params"] == sum(p.numel() for p in model.parameters())
    assert ("", "conv1") in tree.edges


def test_pass_result_and_no_op_note():
    compiled = retarget.compile_for(ZOO["mnist_cnn"].factory())
    record = compiled.history[0]
    assert record.name == "find_blocks" and record.changed is False
    assert record.notes == ("no repeated blocks",)
    llama = retarget.compile_for(ZOO["tiny_llama"].factory())
    assert llama.history[0].stats == {"modules": 33, "block_types": 1, "blocks": 2}
