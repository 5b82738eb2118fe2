"""Structural copies, mixins and weight syncing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from retarget.core.modules import original_class, structural_copy, sync_weights_into, with_mixin


class Tag(nn.Module):
    _retarget_mixin = True

    def tagged(self):
        return True


def test_structural_copy_shares_tensors_not_modules():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    copy = structural_copy(model)
    assert copy is not model and copy[0] is not shared
    assert copy[0] is copy[2]  # used twice, copied once
    assert copy[0].weight is shared.weight
    copy.add_module("extra", nn.Linear(1, 1))
    assert "extra" not in model._modules
    copy.train(False)
    assert model.training


def test_with_mixin_keeps_class_identity_and_is_idempotent():
    layer = nn.Linear(2, 2)
    with_mixin(layer, Tag)
    assert isinstance(layer, nn.Linear) and isinstance(layer, Tag) and layer.tagged()
    cls = type(layer)
    assert with_mixin(layer, Tag) is layer and type(layer) is cls
    assert original_class(layer) is nn.Linear
    assert list(layer.state_dict()) == ["weight", "bias"]


def test_sync_copies_only_tensors_that_are_not_shared():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert sync_weights_into(a, b) == 2
    assert torch.equal(a.weight, b.weight)
    assert sync_weights_into(a, structural_copy(a)) == 0


def _fully_sharded_original_class(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from retarget.core.modules import original_class as original

    dist.init_process_group("gloo")
    block = nn.Sequential(nn.Linear(2, 2))
    fully_shard(block)
    return original(block).__name__


@pytest.mark.distributed
def test_original_class_sees_through_fully_shard():
    from tests.distributed import run_ranks

    assert run_ranks(_fully_sharded_original_class, 1) == ["Sequential"]
