"""Under FSDP a rank holds its shards, not a full copy of the model beside them (issue 18.8).

compile_for keeps the user's model so that unwrap() can hand it back; its parameters must not
keep the full-size storage alive once FSDP2 has sharded the compiled model. Every tensor alive
in each of 2 gloo ranks is counted (tests/fsdp_memory_ranks.py), and unwrap(), unwrap_model and
save_model must still give the trained weights bit for bit.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.fsdp_memory_ranks import TARGETS, memory_rank, sharding_rank


@pytest.mark.distributed
def test_a_rank_holds_its_shards_and_unwrap_gathers_the_trained_weights(tmp_path):
    for rank, out in enumerate(run_ranks(memory_rank, 2, str(tmp_path), timeout=300, fresh=True)):
        for target in TARGETS:
            held, bound, full = out[target]["held"], out[target]["bound"], out[target]["full"]
            print(rank, target, held, "bound", bound, "full model", full)
            # A full copy beside the shards would exceed the bound by about half the model.
            assert bound < full, "the test model is too small to tell shards from a copy"
            for when, nbytes in held.items():
                assert nbytes <= bound, f"rank {rank}, {target}, {when}: {nbytes} > {bound}"
        assert all(out["weights"].values()), out["weights"]
        through = out["accelerator"]
        assert through["target"] == "fsdp" and through["held"] <= through["bound"], through
        assert all(v for k, v in through.items() if k.endswith("bitwise")), through


@pytest.mark.distributed
def test_sharding_never_holds_the_whole_model_and_its_shards_together():
    """The user's model is emptied unit by unit as fully_shard replaces its parameters: a rank
    holds at most the model plus the one unit just sharded (about 1.25x the model here: the
    first block's shard beside everything still whole), never the model plus every shard made
    (1.5x on 2 ranks when the emptying waited for the last unit)."""
    for out in run_ranks(sharding_rank, 2, timeout=300, fresh=True):
        assert out["units"] >= 3, out
        assert out["peak"] < 1.4 * out["full"], out
