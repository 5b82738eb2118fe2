"""Same seed, same data: a prepared loader yields Accelerate's batches in Accelerate's order.

The oracle is the installed accelerate: for rank r of a world of N, `prepare_data_loader(...,
num_processes=N, process_index=r)` builds exactly the objects that rank would (no process group
is needed when every rank starts from the same seed). Both loaders run two epochs with random
numbers drawn between batches (as dropout would), and must agree on every batch, on len(), and
on the random numbers drawn after them (the RNG was consumed alike).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from retarget.compat.accelerate.data_order import AccelerateDraws
from retarget.execution.process import ProcessState
from retarget.runtime.data.sharded_loader import ShardedDataLoader
from retarget.runtime.data.sharding import ShardOptions

accelerate_data = pytest.importorskip("accelerate.data_loader")


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    """Accelerate's loaders read its singletons: a world of one (ranks are passed explicitly)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def two_epochs(loader) -> tuple[list, list[float], list[tuple[int, int]]]:
    """Batches of two epochs, random numbers drawn between batches, (len(), batches) each."""
    batches, noise, lengths = [], [], []
    for _ in range(2):
        before = len(batches)
        length = len(loader)
        for batch in loader:
            batches.append(batch.tolist())
            noise.append(torch.rand(()).item())  # a dropout mask would draw here
        lengths.append((length, len(batches) - before))
    noise.append(torch.rand(()).item())
    return batches, noise, lengths


def accelerate_rank(make, world, rank, **options) -> tuple:
    torch.manual_seed(1234)
    prepared = accelerate_data.prepare_data_loader(
        make(),
        num_processes=world,
        process_index=rank,
        rng_types=["generator"],  # Accelerator's default
        put_on_device=False,
        **options,
    )
    return two_epochs(prepared)


def retarget_rank(make, world, rank, **options) -> tuple:
    torch.manual_seed(1234)
    state = ProcessState(rank=rank, world_size=world)
    shard = ShardOptions(**options, order=AccelerateDraws)
    return two_epochs(ShardedDataLoader(make(), state, options=shard))


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 23),  # RandomSampler refuses an empty dataset
    share=st.integers(1, 4),
    world=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    split=st.booleans(),
    even=st.booleans(),
    own_generator=st.booleans(),
)
def test_every_rank_gets_accelerates_batches_and_rng(
    n, share, world, shuffle, drop_last, split, even, own_generator
):
    batch_size = share * world if split else share

    def make() -> DataLoader:
        generator = torch.Generator().manual_seed(99) if own_generator else None
        return DataLoader(
            list(range(n)),
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            generator=generator,
        )

    options = {"split_batches": split, "even_batches": even}
    for rank in range(world):
        batches, noise, lengths = accelerate_rank(make, world, rank, **options)
        ours = retarget_rank(make, world, rank, **options)
        assert ours[:2] == (batches, noise), f"rank {rank}"
        # len() is what the epoch yields; Accelerate's len (BatchSamplerShard) counts a split
        # round's batch even on a rank that gets nothing of it (even_batches=False)
        assert all(length == count for length, count in ours[2]), "len() is exact"
        assert ours[2] == lengths or (split and not even)


def test_the_grid_includes_shuffled_padded_epochs_that_differ():
    """A case the property test must not pass vacuously: shuffled, padded, two ranks."""

    def make() -> DataLoader:
        return DataLoader(list(range(11)), batch_size=3, shuffle=True)

    batches, _, lengths = retarget_rank(make, 2, 1)
    assert lengths == [(2, 2), (2, 2)] and batches[:2] != batches[2:]
    assert batches == accelerate_rank(make, 2, 1)[0]
    assert retarget_rank(make, 2, 0)[0] != batches


def _train(rank: int, world: int, front_door: str, dispatch: bool) -> tuple[list, list, float]:
    """A tiny dropout model trained 2 epochs on a shuffled loader through `front_door`."""
    from accelerate import DataLoaderConfiguration  # ours converts Accelerate's instances
    from torch import nn
    from torch.nn import functional
    from torch.utils.data import TensorDataset

    if front_door == "accelerate":
        from accelerate import Accelerator
    else:
        from retarget import Accelerator
    config = DataLoaderConfiguration(dispatch_batches=dispatch)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(38, 6, generator=data), torch.randn(38, 1, generator=data)
    loader = DataLoader(
        TensorDataset(torch.arange(38), inputs, targets), batch_size=4, shuffle=True
    )
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, seen = [], []
    for _ in range(2):
        model.train()
        for index, x, y in loader:
            loss = functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            seen.append(index.tolist())
    return losses, seen, torch.rand(()).item()


@pytest.mark.distributed
@pytest.mark.parametrize("dispatch", [False, True])
def test_two_ranks_train_as_under_accelerate(dispatch):
    """2 gloo ranks, DDP in both (Accelerate's cpu=True): same batches, dropout and losses."""
    from tests.distributed import run_ranks

    theirs = run_ranks(_train, 2, "accelerate", dispatch, timeout=180)
    ours = run_ranks(_train, 2, "retarget", dispatch, timeout=180)
    for rank in range(2):
        assert ours[rank][1] == theirs[rank][1], f"rank {rank}: batches"
        assert len(ours[rank][1]) == 10 and ours[rank][1][:5] != ours[rank][1][5:]
        assert ours[rank][0] == pytest.approx(theirs[rank][0], rel=1e-5, abs=1e-7)
        assert ours[rank][2] == theirs[rank][2], f"rank {rank}: RNG consumed alike"
    assert ours[0][1] != ours[1][1]


DISPATCH_GRID = [  # (samples, batch_size, split_batches, drop_last, shuffle)
    (n, b, split, drop, shuffle)
    for n in (1, 7, 8, 13)
    for b in (2, 3, 4)
    for split in (False, True)
    for drop in (False, True)
    for shuffle in (False, True)
    # Accelerate's dispatcher fails when drop_last leaves fewer batches than processes
    if not (split and b % 2) and not (drop and n // b < (1 if split else 2))
]


def _dispatched_both(rank: int, world: int) -> list:
    """Each grid case through accelerate's DataLoaderDispatcher and ours, in one process group."""
    from accelerate import Accelerator as Theirs

    Theirs(cpu=True)  # creates the group; ProcessState adopts it
    state = ProcessState.current()
    mismatches = []
    for case in DISPATCH_GRID:
        n, batch_size, split, drop_last, shuffle = case

        def make(n=n, batch_size=batch_size, drop_last=drop_last, shuffle=shuffle):
            return DataLoader(list(range(n)), batch_size=batch_size, drop_last=drop_last,
                              shuffle=shuffle)  # fmt: skip

        torch.manual_seed(5)
        theirs = accelerate_data.prepare_data_loader(
            make(), num_processes=world, process_index=rank, split_batches=split,
            dispatch_batches=True, rng_types=["generator"], put_on_device=True,
        )  # fmt: skip
        expected = two_epochs(theirs)[:2]
        torch.manual_seed(5)
        options = ShardOptions(split_batches=split, dispatch_batches=True, order=AccelerateDraws)
        ours = two_epochs(ShardedDataLoader(make(), state, options=options))[:2]
        if ours != expected:
            mismatches.append((case, ours, expected))
    return mismatches


@pytest.mark.distributed
def test_dispatch_gives_what_accelerates_dispatcher_sends():
    from tests.distributed import run_ranks

    assert run_ranks(_dispatched_both, 2, timeout=240) == [[], []]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("own_generator", [True, False])
def test_resume_from_an_epochs_end_shuffles_the_next_epoch_as_uninterrupted(world, own_generator):
    """A checkpoint taken after an epoch's last batch: the resumed loader's next epochs are the
    uninterrupted run's, not epoch 0's order again (the loader's own generator, and the sampler
    generator Accelerate adds on several ranks, are saved as they are at the epoch's end)."""

    def make() -> DataLoader:
        generator = torch.Generator().manual_seed(7) if own_generator else None
        return DataLoader(torch.arange(24), batch_size=3, shuffle=True, generator=generator)

    def loader(rank: int) -> ShardedDataLoader:
        state = ProcessState(rank=rank, world_size=world)
        return ShardedDataLoader(make(), state, options=ShardOptions(order=AccelerateDraws))

    for rank in range(world):
        torch.manual_seed(1234)
        straight = loader(rank)
        epochs = [[b.tolist() for b in straight] for _ in range(3)]

        torch.manual_seed(1234)
        first = loader(rank)
        assert [b.tolist() for b in first] == epochs[0]
        saved, rng = first.state_dict(), torch.get_rng_state()  # what a checkpoint holds

        torch.manual_seed(99)  # a new process: the loader and the global RNG start afresh
        resumed = loader(rank)
        resumed.load_state_dict(saved)
        torch.set_rng_state(rng)
        assert [[b.tolist() for b in resumed] for _ in range(2)] == epochs[1:]
        assert epochs[1] != epochs[0]
