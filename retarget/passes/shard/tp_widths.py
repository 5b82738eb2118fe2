"""Does a block's own code run on one rank's share of a chain? Which attributes must shrink?

A captured graph has every size as a literal, so it cannot tell a view written with -1 from one
that reads a full width from a module attribute (GPT-2's `split_size`, Conv1D's `nf`, BERT's
`all_head_size`). The block's eager code can: we give its first repeat rank 0's share of each
split weight (column-wise: the first 1/N of the output features, of each part when fused;
row-wise: the first 1/N of the input features), run it once on the inputs it received from the
example, and compare the output's shape with the full block's. When it fails, the int
attributes that hold a width the chain splits (a head count, a feature width), on the chain's
column-wise Linears and the modules above its Linears, are divided by N, all together, then
each put back while the run still passes: what is left are the attributes the code reads
(`TpPlan.attribute_fixes`), less those on the split Linears themselves (here they run on plain
slices; split by torch's styles, on whole-size DTensors). A chain no fix lets run is broken,
with the error as its reason.
Everything is restored afterwards (weights, attributes, RNG, buffers; the KV cache is a copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from retarget.frontends import one_line
from retarget.frontends.check import preserved_state
from retarget.frontends.state import copy_state_args
from retarget.ir.hooks import users_hooks_set_aside
from retarget.ir.region import running_eagerly
from retarget.passes.shard.tp_chains import Chain, LinearSite

Fix = tuple[str, str, int]
"""(module path relative to the block, attribute, value on each rank)."""


@dataclass
class WidthCheck:
    """Runs one block with rank 0's share of some chains and some attributes shrunk."""

    block: nn.Module
    args: tuple
    kwargs: dict
    linears: dict[str, LinearSite]
    size: int
    expected: tuple[int, ...] | None = None
    """The full block's output shape (the graph's, when it recorded one)."""

    def __post_init__(self) -> None:
        if self.expected is None:
            ok, self.expected = self._run([], [])
            assert ok, f"the block does not run unchanged: {self.expected}"

    def all_fixes(self, chains: list[Chain]) -> dict[int, tuple[list[Fix], str]]:
        """`chain_fixes` of each chain (by index); one run when they all need none."""
        if self.runs(chains, [])[0]:
            return {i: ([], "") for i in range(len(chains))}
        found = {i: self.chain_fixes(chain) for i, chain in enumerate(chains)}
        kept = [i for i, (_, why) in found.items() if not why]
        together = [fix for i in kept for fix in found[i][0]]
        ok, why = self.runs([chains[i] for i in kept], together)
        if kept and not ok:  # each chain runs split on its own, not all of them at once
            reason = f"the block's code fails with its chains split together ({why})"
            found.update({i: ([], reason) for i in kept})
        return {i: (_outside(fixes, chains[i]), why) for i, (fixes, why) in found.items()}

    def chain_fixes(self, chain: Chain) -> tuple[list[Fix], str]:
        """The attribute fixes `chain` needs, or ([], why it cannot run split)."""
        ok, why = self.runs([chain], [])
        if ok:
            return [], ""
        candidates = self.candidates(chain)
        if not candidates or not self.runs([chain], candidates)[0]:
            return [], f"the block's code fails on one rank's share ({why})"
        needed = list(candidates)
        for fix in candidates:
            trial = [f for f in needed if f != fix]
            if self.runs([chain], trial)[0]:
                needed = trial
        return needed, ""

    def candidates(self, chain: Chain) -> list[Fix]:
        widths = set(chain.widths)
        for path, parts in chain.fused.items():
            widths.add(self.linears[path].out_features // parts)
        found = []
        for path, module in self.block.named_modules():
            if path not in _owners(chain):
                continue
            for name, value in vars(module).items():
                if type(value) is int and value in widths and value % self.size == 0:
                    found.append((path, name, value // self.size))
        return found

    def runs(self, chains: list[Chain], fixes: list[Fix]) -> tuple[bool, str]:
        ok, got = self._run(chains, fixes)
        if not ok:
            return False, got
        if got != self.expected:
            return False, f"output shapes {got}, expected {self.expected}"
        return True, ""

    def _run(self, chains: list[Chain], fixes: list[Fix]) -> tuple[bool, Any]:
        args, kwargs = copy_state_args(self.args, self.kwargs)
        try:
            with (
                shares(self.block, chains, self.linears, self.size),
                shrunk(self.block, fixes),
                running_eagerly((self.block,)),
                users_hooks_set_aside(self.block),
                preserved_state(self.block),
                torch.no_grad(),
            ):
                out = self.block(*args, **kwargs)
        except Exception as exc:  # the block's own code refusing the shapes is the answer
            return False, one_line(exc)
        first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        return True, None if first is None else tuple(first.shape)


def _outside(fixes: list[Fix], chain: Chain) -> list[Fix]:
    """The fixes a plan keeps: not those on the chain's own Linears. Here they run on plain
    local weights and need their widths shrunk (Conv1D's `nf`); split by torch's styles they
    run on DTensors of the whole size, and their widths stay."""
    return [fix for fix in fixes if fix[0] not in chain.members]


def _owners(chain: Chain) -> set[str]:
    """The chain's column-wise Linears and the modules above its Linears (up to the block)."""
    owners = set(chain.colwise) | {""}
    for path in chain.colwise + chain.rowwise:
        parts = path.split(".")
        owners |= {".".join(parts[:i]) for i in range(1, len(parts))}
    return owners


@contextlib.contextmanager
def shares(
    block: nn.Module, chains: list[Chain], linears: dict[str, LinearSite], size: int
) -> Iterator[None]:
    """Give the chains' Linears rank 0's share of their weights while inside."""
    saved = []
    try:
        for chain in chains:
            for path in chain.colwise + chain.rowwise:
                module = block.get_submodule(path)
                site = linears[path]
                colwise = path in chain.colwise
                parts = chain.fused.get(path, 1)
                for name in ("weight", "bias"):
                    tensor = module._parameters.get(name)
                    if tensor is None or (name == "bias" and not colwise):
                        continue
                    saved.append((module, name, tensor))
                    share = _share(tensor.detach(), name, site.kind, colwise, parts, size)
                    module._parameters[name] = nn.Parameter(share, requires_grad=False)
        yield
    finally:
        for module, name, tensor in reversed(saved):
            module._parameters[name] = tensor


def _share(
    tensor: torch.Tensor, name: str, kind: str, colwise: bool, parts: int, size: int
) -> torch.Tensor:
    if name == "bias":
        dim = 0
    elif kind == "conv1d":  # weight (in, out)
        dim = 1 if colwise else 0
    else:  # weight (out, in)
        dim = 0 if colwise else 1
    pieces = tensor.chunk(parts, dim) if colwise else (tensor,)
    return torch.cat([p.narrow(dim, 0, p.shape[dim] // size) for p in pieces], dim).clone()


@contextlib.contextmanager
def shrunk(block: nn.Module, fixes: list[Fix]) -> Iterator[None]:
    saved = []
    try:
        for path, name, value in fixes:
            module = block.get_submodule(path)
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
