"""core/placement.py: the planner, sizes, devices, device_for."""

from __future__ import annotations

import pytest
import torch

from retarget.core.placement import (
    DeviceMap,
    PlacementError,
    Unit,
    device_for,
    normalize_budgets,
    normalize_device,
    parse_bytes,
    plan_placement,
)


def test_planner_splits_a_unit_that_does_not_fit():
    parts = (Unit("a.x", 40), Unit("a.y", 40))
    units = [Unit("a", 80, parts=parts), Unit("b", 30)]
    assert plan_placement(units, {"cpu": 50}, largest=None) == {
        "a.x": "cpu",
        "a.y": "disk",
        "b": "disk",
    }


def test_sizes_and_devices_parse():
    assert parse_bytes("70MB") == 70 * 10**6 and parse_bytes("2GiB") == 2 * 2**30
    with pytest.raises(PlacementError, match="bits"):
        parse_bytes("10Mb")
    assert normalize_device(1) == "cuda:1" and normalize_device("cuda") == "cuda:0"
    assert normalize_device(torch.device("cpu")) == "cpu" and normalize_device("disk") == "disk"
    with pytest.raises(PlacementError):
        normalize_device("floppy")


def test_the_execution_device_keeps_room_for_the_largest_unit_only_when_offloading():
    units = [Unit("a", 40), Unit("b", 40), Unit("c", 40)]
    largest = Unit("a", 40, kind="Block")
    assert set(plan_placement(units, {"cpu": 120}, largest=largest).values()) == {"cpu"}
    assert plan_placement(units, {"cpu": 100}, largest=largest) == {
        "a": "cpu",
        "b": "disk",
        "c": "disk",
    }
    with pytest.raises(PlacementError, match=r"too small for one block: a \(Block\) needs 40 B"):
        plan_placement(units, {"cpu": 30}, largest=largest)


def test_accelerators_run_blocks_and_cpu_is_an_offload_device():
    units = [Unit(str(i), 40) for i in range(6)]
    budgets = normalize_budgets({"cpu": 80, 1: 80, 0: 120})
    assert list(budgets) == ["cuda:0", "cuda:1", "cpu"]
    placed = plan_placement(units, budgets, largest=units[0])
    # cuda:0 keeps 40 free for a block brought in from the cpu.
    assert list(placed.values()) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1", "cpu", "cpu"]


def test_device_for_and_describe():
    plan = DeviceMap(
        entries={"a": "cpu", "b.x": "disk"}, sizes={"a": 10, "b.x": 2_000_000}, budgets={"cpu": 50}
    )
    assert device_for(plan, "a.w.weight") == "cpu" and plan.device_of("b.x.bias") == "disk"
    with pytest.raises(PlacementError, match="no prefix of 'b.y'"):
        device_for(plan, "b.y")
    assert plan.describe() == [
        "a    -> cpu           10 B",
        "b.x  -> disk       2.00 MB",
        "cpu: 10 B of 50 B",
        "disk: 2.00 MB",
    ]
    assert dict(plan) == {"a": "cpu", "b.x": "disk"}
