"""Peak memory per rank under fsdp+bf16: retarget against the same training by hand and Accelerate.

    PYTHONPATH=$PWD python bench/fsdp_memory.py [repeats]      # prints one JSON document

Three arms train the same model the same way on 2 gloo ranks (bench/common.py's `llama`, 8
layers, hidden 512, 33.7 M parameters; batch 2 x 64 from a per-rank seed; SGD built on the
model's parameters before sharding; 3 steps):

- `by_hand`: FSDP2 as retarget's runtime applies it for fsdp+bf16 (`fully_shard` per decoder
  layer, then the root, on a 1-D mesh, MixedPrecisionPolicy(param bf16, reduce fp32)), the
  forward under `torch.autocast(bf16)` as retarget's insert_autocast computes it;
- `retarget`: `compile_for(model, "fsdp+bf16", example_inputs=batch)`, the SGD prepared;
- `accelerate`: Accelerate's `Accelerator(cpu=True, mixed_precision="bf16",
  fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`. On CPU-only torch it ignores
  the plugin and runs DDP (docs/facts.md): the arm records what it ran (`ran`, `fsdp_applied`).

Every arm runs in fresh processes (peak resident memory is per process), the arms alternating
`repeats` times. Per rank and per phase (imports, build: model + optimizer, prepare: compile_for
/ fully_shard / accelerator.prepare, steps) it records VmHWM (the kernel's peak resident set,
reset between phases through /proc/self/clear_refs), the peak of RssAnon (anonymous memory:
heap, tensors; not the shared libraries' pages, which differ by what each arm imports) and the
peak of the bytes glibc's malloc has handed out and not yet taken back (`mallinfo2`: uordblks +
hblkhd; tensors and large Python objects, without the freed memory the allocator keeps; small
Python objects live in pymalloc's own mapped arenas and are only in RssAnon), both
sampled every millisecond by a thread. The last is the steady figure: RssAnon during FSDP steps
on gloo also holds hundreds of MB of freed chunks, an amount that moves by tens of MB between
runs of the same arm. bench/test_fsdp_peak.py runs this and writes bench/fsdp_peak.json.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPE = dict(layers=8, hidden=512, intermediate=1376, heads=8, vocab=8192)
ARMS = ("by_hand", "retarget", "accelerate")
STEPS = 3
PHASES = ("imports", "build", "prepare", "steps")
PEAKS = ("hwm", "anon_peak", "heap_peak")


def _status(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            found[name] = int(value.split()[0]) * 1024
    return found


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def heap_in_use() -> int:
    """Bytes malloc has handed out and not taken back: arenas' used chunks + mmapped chunks."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
if not hasattr(_LIBC, "mallinfo2"):
    raise RuntimeError("bench/fsdp_memory.py reads glibc's mallinfo2 (glibc >= 2.33, Linux)")
_LIBC.mallinfo2.restype = _MallInfo2


class PhaseMeter:
    """Peak VmHWM, sampled peak RssAnon and sampled peak heap in use, per phase of this process."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, int]] = {}
        self._anon = self._heap = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._anon = max(self._anon, _status("RssAnon")["RssAnon"])
            self._heap = max(self._heap, heap_in_use())
            time.sleep(0.001)

    def end(self, phase: str) -> None:
        """Close `phase`: its peaks since the previous end; then reset the peaks."""
        now = _status("VmHWM", "VmRSS", "RssAnon")
        heap = heap_in_use()
        self.phases[phase] = {
            "hwm": now["VmHWM"],
            "anon_peak": max(self._anon, now["RssAnon"]),
            "heap_peak": max(self._heap, heap),
            "rss_end": now["VmRSS"],
            "anon_end": now["RssAnon"],
            "heap_end": heap,
        }
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self._anon, self._heap = _status("RssAnon")["RssAnon"], heap_in_use()

    def result(self) -> dict[str, object]:
        self._stop.set()
        self._thread.join()
        peaks = {key: max(p[key] for p in self.phases.values()) for key in PEAKS}
        return {
            **{f"peak_{key.removesuffix('_peak')}": value for key, value in peaks.items()},
            "peak_phase": max(self.phases, key=lambda k: self.phases[k]["heap_peak"]),
            "phases": self.phases,
        }


def _batch(rank: int):
    import torch

    ids = torch.randint(0, SHAPE["vocab"], (2, 64), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids, "labels": ids}


def _train(step, optimizer, meter: PhaseMeter) -> float:
    for _ in range(STEPS):
        loss = step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    meter.end("steps")
    return loss.detach().item()


def by_hand(rank: int, world: int) -> dict[str, object]:
    meter = PhaseMeter()
    import torch
    import torch.distributed as dist
    from common import llama
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo")
    meter.end("imports")
    model = llama(**SHAPE)
    batch = _batch(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    meter.end("build")
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # fully_shard swapped the Parameters: the optimizer is rebuilt on the shards, as by hand.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    meter.end("prepare")

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        return loss

    loss = _train(step, optimizer, meter)
    return {"ran": "fully_shard (FSDP2)", "fsdp_applied": True, "loss": loss, **meter.result()}


def retarget_arm(rank: int, world: int) -> dict[str, object]:
    meter = PhaseMeter()
    import torch
    from common import llama

    import retarget
    from retarget.execution.process import ProcessState

    ProcessState.current()
    meter.end("imports")
    model = llama(**SHAPE)
    batch = _batch(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    meter.end("build")
    compiled = retarget.compile_for(model, "fsdp+bf16", example_inputs=batch)
    optimizer = compiled.runtime.prepare(optimizer)
    meter.end("prepare")

    def step():
        loss = compiled(**batch).loss
        compiled.runtime.backward(loss)
        return loss

    loss = _train(step, optimizer, meter)
    applied = compiled.program.plan.applied
    ran = f"{compiled.program.target}: {applied.wrapped if applied.applied else applied.reason}"
    fsdp = any("FSDP" in type(m).__name__ for m in compiled.modules())
    return {"ran": ran, "fsdp_applied": fsdp, "loss": loss, **meter.result()}


def accelerate_arm(rank: int, world: int) -> dict[str, object]:
    meter = PhaseMeter()
    import torch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from common import llama

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
    meter.end("imports")
    model = llama(**SHAPE)
    batch = _batch(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    meter.end("build")
    model, optimizer = accelerator.prepare(model, optimizer)
    meter.end("prepare")

    def step():
        loss = model(**batch).loss
        accelerator.backward(loss)
        return loss

    loss = _train(step, optimizer, meter)
    ran = str(accelerator.state.distributed_type)
    fsdp = any("FSDP" in type(m).__name__ for m in model.modules())
    return {"ran": ran, "fsdp_applied": fsdp, "loss": loss, **meter.result()}


BODIES = {"by_hand": by_hand, "retarget": retarget_arm, "accelerate": accelerate_arm}


def run_arm(arm: str) -> list[dict[str, object]]:
    """One run of `arm` on 2 fresh gloo ranks: its figures per rank."""
    from tests.distributed import run_ranks

    return run_ranks(BODIES[arm], 2, timeout=900)


def measure(repeats: int, arms: tuple[str, ...] = ARMS) -> dict[str, list[list[dict]]]:
    """`repeats` rounds, each running every arm once in a rotated order."""
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    for r in range(repeats):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            runs[arm].append(run_arm(arm))
    return runs


FIGURES = {
    "peak_hwm": lambda r: r["peak_hwm"],
    "peak_anon": lambda r: r["peak_anon"],
    "peak_hwm above imports": lambda r: r["peak_hwm"] - r["phases"]["imports"]["rss_end"],
    "peak_anon above imports": lambda r: r["peak_anon"] - r["phases"]["imports"]["anon_end"],
    "peak_heap": lambda r: r["peak_heap"],
    "peak_heap above imports": lambda r: r["peak_heap"] - r["phases"]["imports"]["heap_end"],
    "steps' own heap peak": lambda r: (
        r["phases"]["steps"]["heap_peak"] - r["phases"]["prepare"]["heap_end"]
    ),
    # While every rank holds the whole model: compile_for (capture, passes, fully_shard) or
    # fully_shard by hand or accelerator.prepare; the steps' peak is the process's peak here.
    "prepare-phase peak_anon": lambda r: r["phases"]["prepare"]["anon_peak"],
    "prepare-phase peak_heap": lambda r: r["phases"]["prepare"]["heap_peak"],
}


def _median_mb(values) -> float:
    return round(statistics.median(values) / 1e6, 1)


def figures(runs: dict[str, list[list[dict]]]) -> dict[str, object]:
    """Per figure: each arm's median over rounds per rank (MB) and the ratios per rank."""
    out: dict[str, object] = {}
    for name, figure in FIGURES.items():
        # Per rank over rounds, then both ranks' runs pooled (the steadier figure).
        mb = {
            arm: [_median_mb(figure(run[rank]) for run in runs[arm]) for rank in range(2)]
            + [_median_mb(figure(run[rank]) for run in runs[arm] for rank in range(2))]
            for arm in runs
        }
        ratios = {
            f"retarget/{other}": [
                round(r / o, 3) for r, o in zip(mb["retarget"], mb[other], strict=True)
            ]
            for other in ("by_hand", "accelerate")
            if other in mb and "retarget" in mb
        }
        out[name] = {"MB (rank 0, rank 1, pooled)": mb, "ratios": ratios}
    return out


if __name__ == "__main__":
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    runs = measure(repeats)
    print(json.dumps({"figures": figures(runs), "runs": runs}, indent=1))
