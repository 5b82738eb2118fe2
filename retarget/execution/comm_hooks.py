"""The DDP communication hooks the comm_hook pass installs, built from its plan entry.

- fp16-comm / bf16-comm: `cast_compress_hook`, torch's fp16_compress_hook algorithm for any
  16-bit dtype: cast the bucket, divide by the world size, all-reduce, copy back. Ours because
  torch's bf16_compress_hook refuses CPU by its function name even though gloo all-reduces
  bfloat16 fine (docs/facts.md); for float16 it computes bit for bit what torch's hook computes. Its
  state counts what went over the wire (calls, bytes, dtypes), which the report and tests read.
- powersgd: torch's PowerSGDState + powerSGD_hook, optionally inside a cast wrapper
  (`powersgd[wrapper=fp16|bf16]`, Accelerate's comm_wrapper): torch's fp16_compress_wrapper,
  and for bf16 the same wrapper under our own name (torch's is refused on CPU by name too).

No `from __future__ import annotations` here: DDP checks the hook's annotations against the real
objects `dist.GradBucket` and `torch.futures.Future[torch.Tensor]`, not strings.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from retarget.core.plans import CommHookPlan

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class CastHookState:
    """State of `cast_compress_hook`: the group, the wire dtype, and what was sent."""

    dtype: torch.dtype
    process_group: Any = None
    calls: int = 0
    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    wire_dtypes: set[torch.dtype] = field(default_factory=set)

    def stats(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "wire_dtypes": sorted(str(d).removeprefix("torch.") for d in self.wire_dtypes),
        }


def cast_compress_hook(
    state: CastHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in `state.dtype` (divided by the world size first), then copy back."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(state.dtype).div_(group.size())
    state.calls += 1
    state.bytes_sent += compressed.numel() * compressed.element_size()
    state.bytes_uncompressed += buffer.numel() * buffer.element_size()
    state.wire_dtypes.add(compressed.dtype)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def bf16_cast_wrapper(hook: Hook) -> Hook:
    """torch's bf16_compress_wrapper under a name DDP does not refuse on CPU."""

    def bf16_cast_wrapper_hook(
        hook_state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        bucket.set_buffer(bucket.buffer().to(torch.bfloat16))
        fut = hook(hook_state, bucket)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            decompressed = bucket.buffer()
            decompressed.copy_(fut.value())
            return decompressed

        return fut.then(decompress)

    return bf16_cast_wrapper_hook


WRAPPERS: dict[str, Callable[[Hook], Hook]] = {
    "fp16": default_hooks.fp16_compress_wrapper,
    "bf16": bf16_cast_wrapper,
}


def build_hook(plan: CommHookPlan, process_group: Any = None) -> tuple[Any, Hook]:
    """(state, hook) for `program.plan.comm_hook`, ready for `ddp.register_comm_hook`."""
    if plan.kind == "cast":
        return CastHookState(getattr(torch, plan.dtype), process_group), cast_compress_hook
    options = plan.powersgd
    state = powerSGD_hook.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=options["rank"],
        start_powerSGD_iter=options["start_iter"],
        min_compression_rate=options["min_compression_rate"],
        use_error_feedback=options["error_feedback"],
        warm_start=options["warm_start"],
    )
    hook: Hook = powerSGD_hook.powerSGD_hook
    wrapper = options["wrapper"]
    return state, hook if wrapper == "none" else WRAPPERS[wrapper](hook)


def hook_stats(state: Any) -> dict[str, Any]:
    """What a hook state says it sent (cast hooks) or compressed (PowerSGD)."""
    if isinstance(state, CastHookState):
        return state.stats()
    before, after = state.compression_stats()[1:] if state.iter > 0 else (0, 0)
    return {"iterations": state.iter, "numel_before": before, "numel_after": after}
