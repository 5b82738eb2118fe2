"""The xla runtime: prepared loaders through torch_xla's ParallelLoader, metrics, compile counts.

Runs in the xla environment with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 (see
tests/execution/test_xla.py); skipped elsewhere. SPMD is process-wide, so each worker runs in a
fresh process; a module-scoped fixture runs the loader worker once and several tests read its facts
(each new XLA graph costs seconds to compile).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import retarget
from retarget.execution import xla_device as xla
from tests.distributed import run_ranks
from tests.paths import REPO

needs_xla = pytest.mark.skipif(not xla.available(), reason="torch_xla is not importable here")
pytestmark = [pytest.mark.xla, needs_xla]
ROOT = str(REPO)


def _classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(3)]
    return torch.nn.Sequential(torch.nn.Linear(8, 32), *blocks, torch.nn.Linear(32, 4))


def _dataset(rows: int = 40) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(rows, 8, generator=gen), torch.randint(0, 4, (rows,)))


class _Dicts(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((3, 2), float(i)), "label": torch.tensor(i)}


class _FailsAt(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 20:
            raise RuntimeError("sample 20 is corrupt")
        return torch.zeros(8)


def _loader_facts(rank: int, world: int) -> dict:
    """Train 5 steps from a prepared tuple loader beside CPU eager, then evaluate and probe."""
    from retarget.execution.xla_placement import XlaRecompileWarning, xla_steps

    data = _dataset()
    model = _classifier()
    reference = copy.deepcopy(model)
    compiled = retarget.compile_for(model, "xla", example_inputs=(data.tensors[0][:8],))
    run = compiled.runtime
    loader = run.shard(DataLoader(data, batch_size=8))
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    facts: dict = {"specs": [], "where": [], "losses": [], "reference": [], "devices": set()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", XlaRecompileWarning)
        for x, y in loader:
            facts["devices"] |= {str(x.device), str(y.device)}
            facts["specs"].append((xla.sharding_spec(x), xla.sharding_spec(y)))
            facts["where"].append((loader.position, loader.end_of_dataloader))
            loss = torch.nn.functional.cross_entropy(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            facts["losses"].append(loss.item())
            ref_loss = torch.nn.functional.cross_entropy(reference(x.cpu()), y.cpu())
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            facts["reference"].append(ref_loss.item())
        compiled.eval()
        predictions, total = [], torch.zeros(())
        with torch.no_grad():
            for x, _ in loader:
                logits = compiled(x)
                predictions.append(run.gather_for_metrics(logits.argmax(-1)).cpu())
                total = total + run.reduce(logits.sum()).cpu()
    facts["recompile_warnings"] = [str(w.message) for w in caught]
    facts["predictions"] = torch.cat(predictions).tolist()
    facts["eager_predictions"] = reference.eval()(data.tensors[0]).argmax(-1).tolist()
    facts["total"], facts["eager_total"] = total.item(), reference(data.tensors[0]).sum().item()
    facts["runtime_device"] = str(run.device)
    for count, _ in enumerate(loader, start=1):  # stop early: upload threads ran ahead
        if count == 2:
            break
    facts["resume_at"] = loader.state_dict()["position"]
    batch = next(iter(run.shard(DataLoader(_Dicts(), batch_size=8))))
    facts["dict_specs"] = {k: xla.sharding_spec(v) for k, v in batch.items()}
    received = []
    try:
        for batch in run.shard(DataLoader(_FailsAt(), batch_size=8)):
            received.append(tuple(batch.shape))
        facts["error"] = None
    except RuntimeError as error:
        facts["error"] = str(error)
    facts["received_before_error"] = len(received)
    facts["steps"] = xla_steps(compiled).to_dict()
    facts.update(_dropout_after_restore(run.device))
    return facts


def _dropout_after_restore(device: torch.device) -> dict:
    """Dropout masks on the XLA device after RngState goes through files and back."""
    import tempfile
    from pathlib import Path

    from retarget.runtime.state.codec import read_tree, write_tree
    from retarget.runtime.state.rng import RngState

    def mask() -> list[float]:
        return torch.nn.functional.dropout(torch.ones(64, device=device), 0.5).cpu().tolist()

    saved = RngState.capture()
    first = mask()
    with tempfile.TemporaryDirectory() as folder:
        write_tree(Path(folder) / "rng", saved.to_tree())
        loaded = RngState.from_tree(read_tree(Path(folder) / "rng"))
    moved_on = mask()
    loaded.restore()
    return {"xla_seed": saved.xla_seed, "masks": (first, moved_on, mask())}


@pytest.fixture(scope="module")
def loader_facts() -> dict:
    assert os.environ.get("CPU_NUM_DEVICES") == "4", "run the xla tests with CPU_NUM_DEVICES=4"
    return run_ranks(_loader_facts, 1, timeout=900, fresh=True)[0]


@pytest.mark.distributed
def test_the_prepared_loader_shards_every_tensor_of_a_tuple_batch_on_dim_0(loader_facts):
    assert loader_facts["devices"] == {"xla:0"}
    assert loader_facts["specs"] == [("{devices=[4,1]0,1,2,3}", "{devices=[4]0,1,2,3}")] * 5
    assert loader_facts["runtime_device"] == "xla:0"


@pytest.mark.distributed
def test_dict_batches_are_sharded_key_by_key(loader_facts):
    assert loader_facts["dict_specs"] == {
        "x": "{devices=[4,1,1]0,1,2,3}",
        "label": "{devices=[4]0,1,2,3}",
    }


@pytest.mark.distributed
def test_training_from_the_prepared_loader_matches_cpu_eager(loader_facts):
    pairs = zip(loader_facts["losses"], loader_facts["reference"], strict=True)
    for step, (a, b) in enumerate(pairs):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"


@pytest.mark.distributed
def test_loader_bookkeeping_counts_the_batches_the_loop_received(loader_facts):
    # the upload threads run ahead of the loop; position and end_of_dataloader must not
    assert loader_facts["where"] == [(1, False), (2, False), (3, False), (4, False), (5, True)]
    assert loader_facts["resume_at"] == 2


@pytest.mark.distributed
def test_gather_for_metrics_and_reduce_are_the_identity_in_one_spmd_process(loader_facts):
    # one process drives all 4 devices: a sharded output is already the global batch
    assert loader_facts["predictions"] == loader_facts["eager_predictions"]
    assert loader_facts["total"] == pytest.approx(loader_facts["eager_total"], rel=1e-4, abs=1e-4)


@pytest.mark.distributed
def test_a_dataset_error_in_an_upload_thread_reaches_the_loop(loader_facts):
    assert loader_facts["error"] == "sample 20 is corrupt"
    assert loader_facts["received_before_error"] < 3  # batch 3 holds sample 20


@pytest.mark.distributed
def test_an_eval_loop_after_training_is_not_called_a_recompile(loader_facts):
    steps = loader_facts["steps"]
    assert loader_facts["recompile_warnings"] == []
    assert steps["recompiling_steps"] == {}
    assert steps["calls"] == 10 and sum(steps["compiled_per_step"][:3]) > 0
    assert steps["compiled_per_step"][3] == 0  # training step 4: nothing new


def _shape_change(rank: int, world: int) -> dict:
    """Fixed-shape steps, then a batch of another size twice, on one XLA device."""
    from retarget.execution.xla_placement import XlaRecompileWarning, xla_steps

    compiled = retarget.compile_for(
        _classifier(), "xla[spmd=false]", example_inputs=(torch.randn(4, 8),)
    )
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    sizes = [4, 4, 4, 4, 4, 6, 4, 6, 4]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", XlaRecompileWarning)
        for size in sizes:
            x = torch.randn(size, 8)
            loss = compiled(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
    steps = xla_steps(compiled)
    return {
        "warnings": [str(w.message) for w in caught if w.category is XlaRecompileWarning],
        "per_step": steps.per_step(),
        "recompiling": steps.recompiling_steps(),
        "report": str(compiled.report),
        "json": compiled.report.to_dict()["xla"]["steps"],
    }


@pytest.mark.distributed
def test_a_changed_shape_after_warm_up_is_counted_warned_once_and_reported():
    (got,) = run_ranks(_shape_change, 1, timeout=600, fresh=True)
    assert got["per_step"][3] == 0  # step 4: the fixed shape compiles nothing after warm-up
    assert set(got["recompiling"]) == {6} and got["recompiling"][6] > 0
    assert got["per_step"][6:] == [0, 0]  # steps 7 and 8: both shapes' graphs are cached
    (message,) = got["warnings"]
    assert f"step 6 (train) compiled {got['recompiling'][6]} new XLA graph(s)" in message
    assert f"recompiled at step 6 ({got['recompiling'][6]})" in got["report"]
    assert got["json"]["recompiling_steps"] == {"6": got["recompiling"][6]}


@pytest.mark.distributed
def test_inspect_shows_each_parameters_placement_and_xla_sharding_spec():
    command = [sys.executable, "-m", "retarget", "inspect", "tests.zoo:tiny_llama"]
    command += ["--inputs", "tests.zoo:lm_inputs", "--target", "xla"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    sharded = rows["model.layers.0.mlp.gate_proj.weight"]
    assert "dim 0 over fsdp (4)" in sharded and "{devices=[4,1]0,1,2,3}" in sharded
    assert "replicated" in rows["model.embed_tokens.weight"]
    assert "xla steps: no call yet" in done.stdout


def _accelerator_loader(rank: int, world: int) -> dict:
    accelerator = retarget.Accelerator()
    model = _classifier()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    loader = DataLoader(_dataset(24), batch_size=8)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses, ref_losses, specs = [], [], []
    for x, y in loader:
        specs.append(xla.sharding_spec(x))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_loss = torch.nn.functional.cross_entropy(reference(x.cpu()), y.cpu())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    return {
        "device": str(accelerator.device),
        "specs": specs,
        "losses": losses,
        "reference": ref_losses,
    }


@pytest.mark.distributed
def test_the_accelerators_prepared_loader_feeds_sharded_xla_batches():
    (got,) = run_ranks(_accelerator_loader, 1, timeout=600, fresh=True)
    assert got["device"] == "xla:0"
    assert got["specs"] == ["{devices=[4,1]0,1,2,3}"] * 3
    for a, b in zip(got["losses"], got["reference"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.distributed
def test_the_xla_random_stream_is_saved_and_restored(loader_facts):
    first, moved_on, restored = loader_facts["masks"]
    assert isinstance(loader_facts["xla_seed"], int)
    assert moved_on != first  # the stream moves on
    assert restored == first  # and the restored state repeats the saved run's dropout mask
