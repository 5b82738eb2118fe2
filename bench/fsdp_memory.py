"""Peak memory per rank under fsdp+bf16: does a rank hold 1/N of the weights or a full copy more?

    PYTHONPATH=$PWD python bench/fsdp_memory.py

Two gloo ranks; each builds a Llama-style HF model (bench/common.py's `llama`), compiles it for
fsdp+bf16 with an SGD built on the original's parameters (prepared), runs three training steps,
and reports: VmHWM (peak resident set), VmRSS before the model was built and after the steps,
and the bytes of every tensor storage alive after the steps (tests/fsdp_memory_ranks.py's
count). The figures are written by hand into docs/architecture.md (Distribution), with the date
and commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPE = dict(layers=8, hidden=512, intermediate=1376, heads=8, vocab=8192)


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rank_body(rank: int, world: int) -> dict[str, int]:
    import torch
    from common import llama

    import retarget
    from retarget.runtime.process import ProcessState
    from tests.fsdp_memory_ranks import alive_storage_bytes

    ProcessState.current()
    before = _status("VmRSS")
    model = llama(**SHAPE)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, SHAPE["vocab"], (2, 64), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = retarget.compile_for(model, "fsdp+bf16", example_inputs=batch)
    optimizer = compiled.runtime.prepare(optimizer)
    for _ in range(3):
        compiled.runtime.backward(compiled(**batch).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "weights": weights,
        "rss_before": before,
        "peak_rss": _status("VmHWM"),
        "alive_tensors": alive_storage_bytes(),  # collects garbage first
        "rss_after": _status("VmRSS"),
    }


if __name__ == "__main__":
    from tests.distributed import run_ranks

    print(json.dumps(run_ranks(rank_body, 2, timeout=600), indent=1))
