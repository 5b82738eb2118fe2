"""report/graph_history.py: which graph nodes a pass after capture added or changed."""

from __future__ import annotations

import torch
from torch import fx

from retarget.report.graph_history import Change, node_changes


def _traced_pair() -> tuple[str, str]:
    def block(x):
        y = torch.relu(x)
        return torch.sigmoid(y) + 1

    gm = fx.symbolic_trace(block)
    before = gm.code
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    with gm.graph.inserting_after(relu):
        neg = gm.graph.call_function(torch.neg, (relu,))
    relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
    gm.recompile()
    return before, gm.code


def test_node_changes_marks_added_and_rewired_nodes_only():
    before, after = _traced_pair()
    changes = node_changes([("capture_regions", before), ("insert_neg", after)])
    assert changes["neg"] == Change("added", "insert_neg")
    assert changes["sigmoid"] == Change("changed", "insert_neg")  # now reads neg
    assert {"x", "relu", "add", "output"}.isdisjoint(changes)
    assert node_changes([("capture_regions", before)]) == {}
    # A pass that undoes the rewrite leaves nothing highlighted.
    stages = [("capture_regions", before), ("insert_neg", after), ("undo", before)]
    assert node_changes(stages) == {}
