"""Data sharding: the deal's arithmetic for any world, one process as identity, 2 gloo ranks.

Most checks build a ShardedDataLoader for a given rank of a given world in this process (the
sharded path needs no process group once the seed is agreed); the rank body at the end checks
what needs real ranks: the seed broadcast, dispatch, gather_for_metrics over whole epochs.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset
from transformers import BatchEncoding

from retarget.execution.process import ProcessState
from retarget.runtime.collectives import gather_for_metrics
from retarget.runtime.data.sharded_loader import (
    ShardedDataLoader,
    active_loader,
    shard_dataloader,
    skip_first_batches,
)
from retarget.runtime.data.sharding import ShardOptions, deal_rounds, epoch_batches
from tests.distributed import run_ranks


class Stream(IterableDataset):
    """0..n-1 in an order shuffled with torch's global RNG, like a shuffle buffer would."""

    def __init__(self, n: int, shuffle: bool = False):
        self.n, self.shuffle = n, shuffle

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n) if self.shuffle else torch.arange(self.n)
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.n


def rank_batches(loader: DataLoader, world: int, seed: int = 7, **options) -> list[list[list]]:
    """Every rank's batches (as lists) for one epoch, ranks simulated in this process."""
    out = []
    for rank in range(world):
        sharded = ShardedDataLoader(
            loader,
            ProcessState(rank=rank, world_size=world),
            options=ShardOptions(**options),
            seed=seed,
        )
        batches = [b.tolist() for b in sharded]
        assert len(sharded) == len(batches), f"len() of rank {rank} disagrees with iteration"
        out.append(batches)
    return out


def in_rank_order(per_rank: list[list[list]]) -> list:
    """Samples round by round, rank by rank: the order gather concatenates them in."""
    flat = []
    for k in range(max(map(len, per_rank))):
        for batches in per_rank:
            if k < len(batches):
                flat.extend(batches[k])
    return flat


# -- the deal, for any world -----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 40),
    share=st.integers(1, 4),
    world=st.integers(1, 4),
    split=st.booleans(),
    even=st.booleans(),
    drop_last=st.booleans(),
)
def test_deal_covers_every_sample_as_documented(n, share, world, split, even, drop_last):
    batch_size = share * world if split else share
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist()
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    deal = deal_rounds(
        batches,
        world=world,
        batch_size=batch_size,
        split_batches=split,
        even_batches=even,
        drop_last=drop_last,
    )
    per_rank = [deal.parts_of(r) for r in range(world)]
    flat = in_rank_order(per_rank)
    round_size = batch_size if split else batch_size * world
    if drop_last:
        kept = len(flat)
        assert flat == order[:kept] and kept % round_size == 0 and n - kept < round_size
    elif even:
        assert flat == (order * (round_size + 1))[: len(flat)], "wrap-around from the start"
        assert len(flat) == -(-n // round_size) * round_size
        assert deal.duplicates == len(flat) - n
    else:
        assert flat == order and deal.duplicates == 0
    if drop_last or even:
        assert len({len(batches) for batches in per_rank}) == 1, "every rank the same count"
        assert all(len(b) == round_size // world for bs in per_rank for b in bs)
    if deal.rounds:
        assert deal.remainder == n - (len(deal.rounds) - 1) * round_size or drop_last
        assert deal.remainder + deal.duplicates == sum(len(p) for p in deal.rounds[-1] if p)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 30),
    share=st.integers(1, 3),
    world=st.integers(2, 3),
    split=st.booleans(),
    even=st.booleans(),
    drop_last=st.booleans(),
    iterable=st.booleans(),
)
def test_loader_lengths_and_coverage(n, share, world, split, even, drop_last, iterable):
    batch_size = share * world if split else share
    dataset = Stream(n) if iterable else list(range(n))
    loader = DataLoader(dataset, batch_size=batch_size, drop_last=drop_last)
    per_rank = rank_batches(loader, world, split_batches=split, even_batches=even)
    flat = in_rank_order(per_rank)
    if not (even or drop_last):
        assert flat == list(range(n))
    elif not drop_last:
        assert flat[:n] == list(range(n)) and set(flat[n:]) <= set(range(n))


def test_epoch_batches_seeded_by_epoch_and_leaves_rng_alone():
    sampler = BatchSampler(torch.utils.data.RandomSampler(range(50)), 5, False)
    before = torch.random.get_rng_state()
    first, again = epoch_batches(sampler, 3, 0), epoch_batches(sampler, 3, 0)
    assert first == again and first != epoch_batches(sampler, 3, 1)
    assert sorted(i for b in first for i in b) == list(range(50))
    assert torch.equal(torch.random.get_rng_state(), before)
    own = torch.Generator().manual_seed(11)
    loader = DataLoader(range(50), batch_size=5, shuffle=True, generator=own)
    state = own.get_state()
    assert epoch_batches(loader.batch_sampler, 3, 0) == epoch_batches(loader.batch_sampler, 3, 0)
    assert torch.equal(own.get_state(), state), "the loader's own generator is restored"


def test_shuffled_stream_agrees_across_ranks():
    loader = DataLoader(Stream(20, shuffle=True), batch_size=3)
    before = torch.random.get_rng_state()
    per_rank = rank_batches(loader, 2, even_batches=False)
    assert sorted(in_rank_order(per_rank)) == list(range(20)), "ranks read the same order"
    assert in_rank_order(per_rank) != list(range(20)), "and it is shuffled"
    assert torch.equal(torch.random.get_rng_state(), before)


# -- one process -----------------------------------------------------------------------------------


def test_single_process_yields_the_loaders_own_batches():
    plain = DataLoader(list(range(13)), batch_size=4)
    loader = shard_dataloader(plain)
    assert loader.state.world_size == 1 and len(loader) == len(plain) == 4
    assert [b.tolist() for b in loader] == [b.tolist() for b in plain], "no wrap-around padding"
    assert loader.remainder == 1 and loader.duplicates == 0
    stream = DataLoader(Stream(13), batch_size=4, drop_last=True)
    assert [b.tolist() for b in shard_dataloader(stream)] == [b.tolist() for b in stream]
    shuffled = shard_dataloader(DataLoader(list(range(13)), batch_size=4, shuffle=True))
    rng = torch.random.get_rng_state()
    epochs = [[i for b in shuffled for i in b.tolist()] for _ in range(2)]
    assert torch.equal(torch.random.get_rng_state(), rng), "the loop's RNG is not drawn from"
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(13))
    assert epochs[0] != epochs[1] and shuffled.epoch == 1, "the epoch advances by itself"
    shuffled.set_epoch(0)
    assert [i for b in shuffled for i in b.tolist()] == epochs[0]
    batch = torch.arange(4)
    assert gather_for_metrics(None, batch) is batch


def test_end_of_dataloader_and_active_loader_stack():
    outer = shard_dataloader(DataLoader(list(range(6)), batch_size=2))
    inner = shard_dataloader(DataLoader(list(range(4)), batch_size=2))
    assert active_loader() is None
    seen = []
    for _ in outer:
        seen.append((active_loader() is outer, outer.end_of_dataloader))
        for _ in inner:
            assert active_loader() is inner
        assert active_loader() is outer and inner.end_of_dataloader
    assert seen == [(True, False), (True, False), (True, True)]
    assert active_loader() is None
    for _ in outer:
        break
    assert active_loader() is None, "a loop left early pops its loader"


Pair = namedtuple("Pair", "x y")


def test_batches_land_on_the_device_keeping_their_types():
    samples = [{"ids": torch.tensor([i]), "name": f"s{i}"} for i in range(4)]

    def collate(items):
        ids = torch.cat([s["ids"] for s in items])
        return {
            "enc": BatchEncoding({"input_ids": ids}),
            "pair": Pair(ids, [s["name"] for s in items]),
            "nested": [(ids,)],
        }

    loader = shard_dataloader(DataLoader(samples, batch_size=2, collate_fn=collate), device="meta")
    batch = next(iter(loader))
    assert isinstance(batch["enc"], BatchEncoding) and batch["enc"]["input_ids"].is_meta
    assert isinstance(batch["pair"], Pair) and batch["pair"].x.is_meta
    assert batch["pair"].y == ["s0", "s1"] and batch["nested"][0][0].is_meta


# -- resume ----------------------------------------------------------------------------------------


def test_skip_first_batches_resumes_the_same_epoch_order():
    base = DataLoader(list(range(30)), batch_size=3, shuffle=True)
    state = ProcessState(rank=1, world_size=2)
    loader = ShardedDataLoader(base, state, seed=5)
    loader.set_epoch(2)
    full = [b.tolist() for b in loader]
    assert loader.state_dict() == {"epoch": 3, "position": 0, "seed": 5}
    loader.set_epoch(2)
    resumed = skip_first_batches(loader, 2)
    assert len(resumed) == len(full) - 2
    assert [b.tolist() for b in resumed] == full[2:]
    assert resumed.position == len(full) and [b.tolist() for b in resumed] != full
    assert resumed.epoch == 3, "only the first iteration skips"

    partway = ShardedDataLoader(base, state, seed=5)
    partway.set_epoch(2)
    for i, _ in enumerate(partway):
        if i == 2:
            break
    saved = partway.state_dict()
    assert saved == {"epoch": 2, "position": 3, "seed": 5}
    fresh = ShardedDataLoader(base, state, seed=99)
    fresh.load_state_dict(saved)
    assert [b.tolist() for b in fresh] == full[3:]


def test_skip_first_batches_on_plain_loaders():
    plain = DataLoader(list(range(10)), batch_size=3)
    skipped = skip_first_batches(plain, 2)
    assert len(skipped) == 2 and [b.tolist() for b in skipped] == [[6, 7, 8], [9]]
    assert len([*skipped]) == 4, "later epochs are whole"
    stream = skip_first_batches(DataLoader(Stream(10), batch_size=3), 3)
    assert len(stream) == 1 and [b.tolist() for b in stream] == [[9]]


# -- bad input -------------------------------------------------------------------------------------


def test_refusals_name_the_setting():
    two = ProcessState(rank=0, world_size=2)
    with pytest.raises(ValueError, match="batch size is 3; use a batch size that is a multiple"):
        ShardedDataLoader(
            DataLoader(range(9), batch_size=3), two, options=ShardOptions(split_batches=True)
        )
    distributed = DistributedSampler(range(8), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="already uses a DistributedSampler"):
        ShardedDataLoader(DataLoader(range(8), sampler=distributed, batch_size=2), two)
    with pytest.raises(ValueError, match="batch_size=None"):
        ShardedDataLoader(DataLoader(range(8), batch_size=None), two)
    varying = [[0], [1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="use even_batches=False"):
        ShardedDataLoader(DataLoader(range(6), batch_sampler=varying), two)
    free = ShardedDataLoader(
        DataLoader(range(6), batch_sampler=varying), two, options=ShardOptions(even_batches=False)
    )
    assert [b.tolist() for b in free] == [[0], [3, 4, 5]]
    with pytest.raises(ValueError, match="num_batches=-1"):
        skip_first_batches(free, -1)


# -- two real ranks --------------------------------------------------------------------------------


class Samples(torch.utils.data.Dataset):
    """Sample i: {"x": [i, -i] float, "idx": i, "name": "s<i>"}; counts reads per process."""

    def __init__(self, n: int):
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.reads += 1
        return {"x": torch.tensor([i, -i], dtype=torch.float32), "idx": i, "name": f"s{i}"}


def _epoch(loader: ShardedDataLoader, state: ProcessState) -> dict:
    """One epoch: local indices, and what gather_for_metrics returns for 3 structures."""
    local, tensors, dicts, names = [], [], [], []
    for batch in loader:
        assert batch["x"].device == state.device
        local.append(batch["idx"].tolist())
        tensors.append(gather_for_metrics(state, batch["idx"]))
        dicts.append(gather_for_metrics(state, {"x": batch["x"], "idx": batch["idx"]}))
        names.extend(gather_for_metrics(state, batch["name"]))
        mixed = gather_for_metrics(state, {"idx": batch["idx"], "name": batch["name"]})
        assert mixed["name"] == [f"s{i}" for i in mixed["idx"].tolist()]
    order = epoch_batches(loader.base_loader.batch_sampler, loader.seed, loader.epoch)
    return {
        "local": local,
        "order": [i for b in order for i in b],
        "gathered": torch.cat(tensors).tolist(),
        "dict_idx": torch.cat([d["idx"] for d in dicts]).tolist(),
        "dict_x": torch.cat([d["x"] for d in dicts])[:, 0].tolist(),
        "names": names,
    }


def _data_ranks(rank: int, world: int) -> dict:
    torch.manual_seed(100 + rank)  # ranks' own RNGs differ: agreement must come from the seed
    state = ProcessState.current()
    out: dict = {}

    def run(name, dataset, batch_size, epochs=2, drop_last=False, **options):
        plain = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=drop_last)
        loader = shard_dataloader(plain, state, **options)
        out[name] = {"seed": loader.seed, "epochs": [_epoch(loader, state) for _ in range(epochs)]}
        return loader

    run("even", Samples(13), 2)
    run("split_uneven_last", Samples(15), 4, split_batches=True, even_batches=False)
    run("split_even", Samples(13), 4, split_batches=True)
    run("drop_last", Samples(13), 2, drop_last=True)
    dataset = Samples(13)
    run("dispatch", dataset, 2, dispatch_batches=True)
    out["dispatch_reads"] = dataset.reads
    # the same loaders without the gathers, where ranks' batch counts differ
    for name, options in {"uneven": {}, "uneven_dispatch": {"dispatch_batches": True}}.items():
        loader = shard_dataloader(
            DataLoader(Samples(13), batch_size=2, shuffle=True),
            state,
            even_batches=False,
            seed=3,
            **options,
        )
        out[name] = [[b["idx"].tolist() for b in loader] for _ in range(2)]
    for name, dispatch in {"stream": False, "stream_dispatch": True}.items():
        plain = DataLoader(Stream(13, shuffle=True), batch_size=2)
        loader = shard_dataloader(plain, state, seed=4, dispatch_batches=dispatch)
        batches, gathered = [], []
        for batch in loader:
            batches.append(batch.tolist())
            gathered.append(gather_for_metrics(state, batch))
        out[name] = {"local": batches, "gathered": torch.cat(gathered).tolist()}
    resumed = shard_dataloader(DataLoader(Samples(13), batch_size=2, shuffle=True), state, seed=9)
    resumed.set_epoch(1)
    whole = [b["idx"].tolist() for b in resumed]
    resumed.set_epoch(1)
    out["resume"] = (whole, [b["idx"].tolist() for b in skip_first_batches(resumed, 2)])
    return out


@pytest.mark.distributed
def test_two_ranks_shard_gather_dispatch_and_resume():
    zero, one = run_ranks(_data_ranks, 2)
    for name in ("even", "split_uneven_last", "split_even", "drop_last", "dispatch"):
        a, b = zero[name], one[name]
        assert a["seed"] == b["seed"], f"{name}: the seed is agreed"
        for e0, e1 in zip(a["epochs"], b["epochs"], strict=True):
            assert e0["order"] == e1["order"], f"{name}: ranks shuffle alike"
            assert e0["gathered"] == e1["gathered"]
            expected = e0["order"]
            if name == "drop_last":
                expected = expected[: len(e0["gathered"])]
                assert len(expected) == 12
            assert e0["gathered"] == expected, f"{name}: gather_for_metrics = the epoch in order"
            assert e0["dict_idx"] == e0["dict_x"] == expected
            assert e0["names"] == [f"s{i}" for i in expected]
        assert a["epochs"][0]["order"] != a["epochs"][1]["order"], f"{name}: epochs differ"
    even = [zero["even"]["epochs"][0]["local"], one["even"]["epochs"][0]["local"]]
    assert len(even[0]) == len(even[1]) == 4 and all(len(b) == 2 for r in even for b in r)
    assert len(in_rank_order(even)) == 16, "3 samples wrapped around to complete the last round"
    for epoch in range(2):
        for result in (zero, one):
            dispatched = result["dispatch"]["epochs"][epoch]["local"]
            assert dispatched == result["even"]["epochs"][epoch]["local"], "same as sharded"
    assert zero["dispatch_reads"] > 0 and one["dispatch_reads"] == 0, "only rank 0 reads"
    for epoch in range(2):
        sharded = [zero["uneven"][epoch], one["uneven"][epoch]]
        assert sorted(in_rank_order(sharded)) == list(range(13)), "every sample exactly once"
        assert [zero["uneven_dispatch"][epoch], one["uneven_dispatch"][epoch]] == sharded
    assert zero["stream"]["local"] == zero["stream_dispatch"]["local"]
    assert one["stream"]["local"] == one["stream_dispatch"]["local"]
    stream = [zero["stream"]["local"], one["stream"]["local"]]
    assert sorted(in_rank_order(stream)[:13]) == list(range(13)), "no item on two ranks"
    for result in (zero, one):
        gathered = result["stream"]["gathered"]
        assert sorted(gathered) == list(range(13))
        assert gathered == result["stream_dispatch"]["gathered"]
        whole, resumed = result["resume"]
        assert resumed == whole[2:]
