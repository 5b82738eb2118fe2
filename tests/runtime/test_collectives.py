"""Collectives: identity in a world of one; on 2 gloo ranks uneven gathers, padding, reductions,
broadcasts, refused dtypes as bytes, and structure mismatches that raise on both ranks (no hang).
"""

from __future__ import annotations

import pytest
import torch

from retarget.execution.process import ProcessState
from retarget.runtime.collectives import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_for_metrics,
    gather_object,
    pad_across_processes,
    reduce,
)
from tests.distributed import run_ranks


def test_world_of_one_passes_everything_through():
    data = {"a": torch.arange(3), "b": [torch.ones(2, 2), "text"]}
    state = ProcessState.current(cpu=True)
    for result in (
        gather(None, data),
        gather_for_metrics(state, data),
        reduce(None, data, "mean"),
        pad_across_processes(None, data, dim=1),
        broadcast(None, data),
    ):
        assert result is data
    assert gather_object(None, ["x", "y"]) == ["x", "y"]
    assert gather_object(None, {"k": 1}) == [{"k": 1}], "one entry per rank, as on N ranks"
    assert broadcast_object_list(None, [1, "a"]) == [1, "a"]
    with pytest.raises(ValueError, match="reduction='max' is not one of"):
        reduce(None, data, "max")


def _outcome(fn):
    """('ok', value) or (error type, message): lets a rank report an expected failure."""
    try:
        return "ok", fn()
    except (ValueError, TypeError) as error:
        return type(error).__name__, str(error)


def _collective_ranks(rank: int, world: int) -> dict:
    state = ProcessState.current()
    rows = rank + 2  # rank 0: 2 rows, rank 1: 3 rows
    out: dict = {}
    data = {
        "f": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * rank,
        "scalar": torch.tensor(float(rank)),
        "nested": [(torch.full((rows,), rank, dtype=torch.int16), "keep")],
        "f8": torch.full((rows, 2), 0.5 + rank, dtype=torch.float8_e4m3fn),
        "bf16": torch.full((rows,), 1.5 + rank, dtype=torch.bfloat16),
        "mask": torch.tensor([rank == 1] * rows),
    }
    got = gather(state, data)
    out["gather"] = {
        "f": got["f"].tolist(),
        "scalar": got["scalar"].tolist(),
        "int16": (got["nested"][0][0].dtype, got["nested"][0][0].tolist()),
        "keep": got["nested"][0][1],
        "f8": (got["f8"].dtype, got["f8"].float().tolist()),
        "bf16": (got["bf16"].dtype, got["bf16"].float().tolist()),
        "mask": got["mask"].tolist(),
    }
    out["empty"] = gather(state, torch.zeros(0 if rank == 0 else 2, 4)).shape
    out["gather_object"] = gather_object(state, [f"r{rank}"] * rows)
    out["gather_object_dict"] = gather_object(state, {"rank": rank})
    out["metrics_objects"] = gather_for_metrics(state, [f"r{rank}"], use_gather_object=True)
    out["metrics_mixed"] = gather_for_metrics(
        state, {"n": torch.tensor([rank]), "w": [rank], "k": 5}
    )
    seq = torch.ones(2, 3 + 2 * rank, dtype=torch.long)
    out["pad"] = pad_across_processes(state, {"s": seq, "v": torch.ones(2)}, dim=1, pad_index=-1)
    out["pad_first"] = pad_across_processes(state, seq, dim=-1, pad_first=True).tolist()
    out["sum"] = reduce(state, {"x": torch.tensor([1.0, 2.0]) * (rank + 1)})["x"].tolist()
    out["mean"] = reduce(state, torch.tensor([rank + 1, 4]), "mean").tolist()
    source = {"t": torch.arange(4.0) * 7, "f8": torch.ones(2, dtype=torch.float8_e5m2), "s": "hi"}
    sent = broadcast(state, source if rank == 1 else None, from_process=1)
    out["broadcast"] = (sent["t"].tolist(), sent["f8"].dtype, sent["f8"].float().tolist())
    out["broadcast_rest"] = sent["s"]
    out["objects"] = broadcast_object_list(state, [rank, {"r": rank}])
    # mistakes: every rank raises the same error, and the group still works afterwards
    out["mismatch"] = _outcome(lambda: gather(state, torch.zeros(2, 3 + rank)))
    out["structure"] = _outcome(
        lambda: gather(state, {"a": torch.zeros(1)} if rank else {"b": torch.zeros(1)})
    )
    out["reduce_shape"] = _outcome(lambda: reduce(state, torch.zeros(2 + rank)))
    out["reduce_f8"] = _outcome(lambda: reduce(state, torch.zeros(2, dtype=torch.float8_e4m3fn)))
    out["after"] = gather(state, torch.tensor([rank])).tolist()
    return out


@pytest.mark.distributed
def test_two_ranks():
    zero, one = run_ranks(_collective_ranks, 2)
    assert zero["gather"] == one["gather"] and zero["pad_first"] != one["pad_first"]
    got = zero["gather"]
    f = torch.arange(6.0).reshape(2, 3).tolist() + (torch.arange(9.0).reshape(3, 3) + 100).tolist()
    assert got["f"] == f, "uneven first dims: rank 0's rows, then rank 1's, nothing padded"
    assert got["scalar"] == [0.0, 1.0] and got["keep"] == "keep"
    assert got["int16"] == (torch.int16, [0, 0, 1, 1, 1]), "int16 travels as bytes"
    assert got["f8"] == (torch.float8_e4m3fn, [[0.5, 0.5]] * 2 + [[1.5, 1.5]] * 3)
    assert got["bf16"] == (torch.bfloat16, [1.5] * 2 + [2.5] * 3)
    assert got["mask"] == [False] * 2 + [True] * 3
    assert zero["empty"] == torch.Size([2, 4])
    assert zero["gather_object"] == one["gather_object"] == ["r0"] * 2 + ["r1"] * 3
    assert zero["gather_object_dict"] == [{"rank": 0}, {"rank": 1}]
    assert zero["metrics_objects"] == ["r0", "r1"]
    mixed = one["metrics_mixed"]
    assert mixed["n"].tolist() == [0, 1] and mixed["w"] == [0, 1] and mixed["k"] == [5, 5]
    pad = zero["pad"]["s"]
    assert pad.shape == (2, 5) and pad[0].tolist() == [1, 1, 1, -1, -1]
    assert torch.equal(one["pad"]["s"], torch.ones(2, 5, dtype=torch.long))
    assert torch.equal(zero["pad"]["v"], torch.ones(2)), "a tensor without that dim is kept"
    assert zero["pad_first"] == [[0, 0, 1, 1, 1]] * 2
    assert zero["sum"] == one["sum"] == [3.0, 6.0]
    assert zero["mean"] == one["mean"] == [1.5, 4.0]
    for result in (zero, one):
        assert result["broadcast"] == ([0.0, 7.0, 14.0, 21.0], torch.float8_e5m2, [1.0, 1.0])
        assert result["broadcast_rest"] == "hi"
        assert result["objects"] == [0, {"r": 0}]
        assert result["mismatch"][0] == "ValueError"
        assert "tensor at <root> is torch.float32 (2, 4) on rank 1" in result["mismatch"][1]
        assert "only the first dimension may differ" in result["mismatch"][1]
        assert result["structure"] == (
            "ValueError",
            "gather: rank 1 passed tensors at [\"['a']\"] but rank 0 at [\"['b']\"]; "
            "every process must pass the same structure",
        )
        assert result["reduce_shape"][0] == "ValueError"
        assert result["reduce_f8"][0] == "TypeError" and "tensor.float()" in result["reduce_f8"][1]
        assert result["after"] == [0, 1]
