"""How the report says a region runs (report/module_decisions.how_captured), for the ways a
region can end up running its own forward."""

from __future__ import annotations

from retarget.execution.tp_regions import DEFERRED_REASON, RECAPTURE_FRONTENDS, RECAPTURE_REASON
from retarget.ir.region import Region
from retarget.report.module_decisions import how_captured


def _region() -> Region:
    return Region(name="layers.*", block_type="Block", paths=["layers.0", "layers.1"])


def test_a_region_deferred_from_the_start_says_no_pass_rewrites_it():
    region = _region()
    region.defer("capture=auto")
    assert how_captured(region) == "own forward: no pass rewrites its graph"


def test_a_split_region_deferred_after_the_split_says_tp_split_it():
    region = _region()
    region.recapture(RECAPTURE_FRONTENDS, RECAPTURE_REASON)  # what tp_regions does, then
    region.defer(DEFERRED_REASON)
    assert (
        how_captured(region) == "own forward: split by tp, no pass rewrites or compiles its graph"
    )
    region.add_transform("a_rewrite", lambda gm: None)  # a rewrite added later needs graphs
    assert not region.deferred and how_captured(region) == "captured at first call"
    assert region.frontends == RECAPTURE_FRONTENDS
