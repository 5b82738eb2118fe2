"""fsdp[cpu_ram_efficient_loading=true]: rank 0 holds the weights, the other ranks a model on the
meta device (as transformers' from_pretrained builds it there); after compile_for every rank
trains from rank 0's values, and a rank other than 0 never had the whole model resident.

Resident memory is read from the kernel (VmHWM, the peak, reset through clear_refs), so a
full copy anywhere on rank 1, even a transient one, shows.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

TARGET = "fsdp[cpu_ram_efficient_loading=true]"


def _config():
    from transformers import LlamaConfig

    # About 33 M parameters (133 MB in float32), none larger than 1/8 of the model, so a rank's
    # half plus one parameter in flight stays far below a whole copy.
    return LlamaConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
    )


def _built_on_rank(config, rank: int):
    """The model from seed 0 on rank 0, on meta elsewhere: what a user of rank-0 loading builds."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    if rank == 0:
        return LlamaForCausalLM(config)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _peak_mib_reset() -> float:
    """This process's peak resident memory so far (MiB); the peak restarts from now."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return kib / 1024


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def _rank_body(rank: int, world: int) -> dict:
    from transformers import LlamaForCausalLM

    import retarget

    config = _config()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    # Imports and first-capture caches warmed on a small model of the same class, so the peak
    # below is the large model's.
    small = config.__class__(
        **{
            **config.to_dict(),
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 64,
            "vocab_size": 64,
        }
    )
    small_batch = {"input_ids": ids % 64, "labels": ids % 64}
    retarget.compile_for(LlamaForCausalLM(small), TARGET, example_inputs=small_batch)
    model = _built_on_rank(config, rank)
    full_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    before = _resident_mib()
    _peak_mib_reset()
    compiled = retarget.compile_for(model, TARGET, example_inputs=batch)
    grew = _peak_mib_reset() - before
    loss = compiled(**batch).loss
    loss.backward()
    state = {k: v.clone() for k, v in compiled.unwrap().state_dict().items()}
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    expected_loss = reference(**batch).loss
    # The other sharded strategies: zero2 (kept gathered), and hsdp, whose replicate dim
    # receives rank 0's tensor whole by broadcast before each row scatters it.
    others = {}
    for target in (
        "zero2[cpu_ram_efficient_loading=true]",
        "hsdp[cpu_ram_efficient_loading=true,replicate=2,shard=1]",
    ):
        model = _built_on_rank(small, rank)
        got = retarget.compile_for(model, target, example_inputs=small_batch).unwrap()
        torch.manual_seed(0)
        want = LlamaForCausalLM(small).state_dict()
        others[target] = all(torch.equal(v, got.state_dict()[k]) for k, v in want.items())
    return {
        "others": others,
        "full_mib": full_mib,
        "grew_mib": grew,
        "same_weights": sorted(
            k for k, v in reference.state_dict().items() if torch.equal(v, state[k])
        )
        == sorted(state),
        "loss": loss.item(),
        "expected_loss": expected_loss.item(),
        "report": str(compiled.report),
    }


@pytest.mark.distributed
def test_ranks_other_than_0_start_on_meta_and_train_from_rank_0s_weights():
    outs = run_ranks(_rank_body, 2, timeout=400, fresh=True)
    for rank, out in enumerate(outs):
        print(rank, {k: v for k, v in out.items() if k != "report"})
        assert out["same_weights"], f"rank {rank} does not hold rank 0's weights"
        assert out["loss"] == pytest.approx(out["expected_loss"], rel=1e-6, abs=0)
        assert "cpu_ram_efficient_loading: rank 0's weights" in out["report"]
        assert all(out["others"].values()), out["others"]
    # Rank 1 ends with half the model; a whole copy at any moment would add the other half.
    assert outs[1]["grew_mib"] < 0.7 * outs[1]["full_mib"], outs[1]
