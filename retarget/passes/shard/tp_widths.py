"""Does a block's own code run on one rank's share of a chain? Which attributes must shrink?

A captured graph has every size as a literal, so it cannot tell a view written with -1 from one
that reads a full width from a module attribute (GPT-2's `split_size`, Conv1D's `nf`, BERT's
`all_head_size`). The block's eager code can: we give its first repeat rank 0's share of each
split weight (column-wise: the first 1/N of the output features, of each part when fused;
row-wise: the first 1/N of the input features), run it on the inputs it received from the
example, and compare the output's shape with the full block's; then its values: each rank's
share run in turn in one process, the row-wise Linears' outputs summed as the all-reduce would,
must give the whole block's output (a width left whole can keep the shapes right and the values
wrong: Phi3's value slice running past its local tensor comes out empty and attention
broadcasts it). When it fails, the int attributes that hold a width the chain splits (a head
count, a feature width), on the chain's column-wise Linears and the modules above its Linears
(and on their `config`, which a module then gets a copy of: Phi3's attention reads its query
width from `config.num_attention_heads`), are divided by N, all together, then each put back
while the shapes still match, and what is left must give the right values (else the same again,
checking the values at each step, which costs a forward per rank and row-wise call): what is
left are the attributes the code reads
(`TpPlan.attribute_fixes`), less those on the split Linears themselves (here they run on plain
slices; split by torch's styles, on whole-size DTensors). A chain no fix lets run is broken,
with the error as its reason.
Everything is restored afterwards (weights, attributes, RNG, buffers, training modes; the KV
cache is a copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from retarget.core.tp_split_dims import RowOrder, set_width, split_dims
from retarget.frontends import one_line
from retarget.frontends.check import preserved_state
from retarget.frontends.state import copy_state_args
from retarget.ir.hooks import users_hooks_set_aside
from retarget.ir.region import running_eagerly
from retarget.passes.shard.tp_chains import Chain
from retarget.passes.shard.tp_linear_sites import LinearSite

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
    reference: torch.Tensor | None = None
    """The full block's first output in eval mode (computed at the first value check)."""

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
        # Put fixes back while the shapes still match (one forward each), then check the
        # values of what is left; only when those differ, again with the values checked each
        # time (a forward per rank and row-wise call each).
        needed = self._fewest([chain], candidates, values=False)
        if not self.runs([chain], needed)[0]:
            needed = self._fewest([chain], candidates, values=True)
        return needed, ""

    def _fewest(self, chains: list[Chain], candidates: list[Fix], *, values: bool) -> list[Fix]:
        needed = list(candidates)
        for fix in candidates:
            trial = [f for f in needed if f != fix]
            if self.runs(chains, trial, values=values)[0]:
                needed = trial
        return needed

    def candidates(self, chain: Chain) -> list[Fix]:
        widths = set(chain.widths)
        for path, parts in chain.fused.items():
            widths.add(self.linears[path].out_features // parts)
        for path, parts in chain.parts.items():  # the split ones: a part kept whole keeps
            whole = chain.whole_parts.get(path, ())  # its width (and a head's, often equal)
            widths.update(w for i, w in enumerate(parts) if i not in whole)
        found = []
        for path, module in self.block.named_modules():
            if path not in _owners(chain):
                continue
            for name, value in _int_attributes(module):
                if value in widths and value % self.size == 0:
                    found.append((path, name, value // self.size))
        return found

    def runs(
        self, chains: list[Chain], fixes: list[Fix], *, values: bool = True
    ) -> tuple[bool, str]:
        ok, got = self._run(chains, fixes)
        if not ok:
            return False, got
        if got != self.expected:
            return False, f"output shapes {got}, expected {self.expected}"
        return self.same_values(chains, fixes) if values else (True, "")

    def same_values(self, chains: list[Chain], fixes: list[Fix]) -> tuple[bool, str]:
        """The split computed in one process: every rank's share run in turn, the row-wise
        Linears' outputs summed over the ranks (the all-reduce), in the order the block calls
        them (an output summed feeds the next chain on every rank). The block's output must
        equal the whole block's: a fix that only gets the shapes right (a slice that runs past
        the local tensor and comes out empty) is not a fix. Dropout off (eval) for both."""
        if self.reference is None:
            self.reference = self._output([], [], 0, {})
        summed: dict[tuple[str, int], torch.Tensor] = {}
        while True:
            partial: dict[tuple[str, int], list[torch.Tensor]] = {}
            for rank in range(self.size):
                self._output(chains, fixes, rank, summed, partial)
            pending = [key for key in partial if key not in summed]
            if not pending:
                break
            path, _ = key = pending[0]  # the first in call order: its inputs were all summed
            bias = getattr(self.block.get_submodule(path), "bias", None)
            total = torch.stack(partial[key]).sum(0)
            summed[key] = total if bias is None else total - (self.size - 1) * bias.detach()
        got = self._output(chains, fixes, 0, summed)
        reference = self.reference
        if got is None or reference is None or got.shape != reference.shape:
            return False, "the split block's output has another shape"
        scale = reference.abs().max().item() or 1.0
        tolerance = max(1e-4, 8 * torch.finfo(reference.dtype).eps) * scale
        error = (got - reference).abs().max().item()
        if error > tolerance:
            return False, (
                f"one process simulating the split gets other values than the whole block "
                f"(largest difference {error:.3g})"
            )
        return True, ""

    def _output(
        self,
        chains: list[Chain],
        fixes: list[Fix],
        rank: int,
        summed: dict[tuple[str, int], torch.Tensor],
        partial: dict[tuple[str, int], list[torch.Tensor]] | None = None,
    ) -> torch.Tensor | None:
        """The first output tensor of one eval-mode run on `rank`'s share, with the row-wise
        outputs in `summed` put in place and the others recorded into `partial`."""
        calls: dict[str, int] = {}

        def rowwise(path: str, _module: nn.Module, _args: Any, output: Any) -> Any:
            key = (path, calls.get(path, 0))
            calls[path] = key[1] + 1
            # Copies both ways: the block may add into a Linear's output in place (Falcon).
            if key in summed:
                return summed[key].clone()
            if partial is not None:
                partial.setdefault(key, []).append(output.detach().clone())
            return None

        handles = [
            self.block.get_submodule(path).register_forward_hook(
                lambda m, a, o, path=path: rowwise(path, m, a, o)
            )
            for chain in chains
            for path in chain.rowwise
        ]
        modes = [(m, m.training) for m in self.block.modules()]
        try:
            self.block.eval()
            ok, out = self._run(chains, fixes, rank=rank, keep_output=True)
        finally:
            for handle in handles:
                handle.remove()
            for module, mode in modes:
                module.training = mode
        if not ok:
            return None
        return next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)

    def _run(
        self, chains: list[Chain], fixes: list[Fix], *, rank: int = 0, keep_output: bool = False
    ) -> tuple[bool, Any]:
        args, kwargs = copy_state_args(self.args, self.kwargs)
        try:
            with (
                shares(self.block, chains, self.linears, self.size, rank),
                shrunk(self.block, fixes),
                running_eagerly((self.block,)),
                users_hooks_set_aside(self.block),
                preserved_state(self.block),
                torch.no_grad(),
            ):
                out = self.block(*args, **kwargs)
        except Exception as exc:  # the block's own code refusing the shapes is the answer
            return False, one_line(exc)
        if keep_output:
            return True, out
        first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        return True, None if first is None else tuple(first.shape)


def _int_attributes(module: nn.Module) -> list[tuple[str, int]]:
    """The module's int attributes, and its config's as "config.NAME"."""
    found = [(name, value) for name, value in vars(module).items() if type(value) is int]
    config = vars(module).get("config")
    if config is not None and hasattr(config, "to_dict"):  # a transformers config
        found += [(f"config.{n}", v) for n, v in vars(config).items() if type(v) is int]
    return found


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
    block: nn.Module,
    chains: list[Chain],
    linears: dict[str, LinearSite],
    size: int,
    rank: int = 0,
) -> Iterator[None]:
    """Give the chains' Linears `rank`'s share of their weights while inside."""
    saved = []
    try:
        for chain in chains:
            for path in chain.colwise + chain.rowwise:
                module = block.get_submodule(path)
                site = linears[path]
                colwise = path in chain.colwise
                parts = chain.parts.get(path) or chain.fused.get(path, 1)
                whole = chain.whole_parts.get(path, ())
                for name in ("weight", "bias"):
                    tensor = module._parameters.get(name)
                    if tensor is None or (name == "bias" and not colwise):
                        continue
                    saved.append((module, name, tensor))
                    share = _share(
                        tensor.detach(), name, site.kind, colwise, parts, size, rank, whole
                    )
                    module._parameters[name] = nn.Parameter(share, requires_grad=False)
        yield
    finally:
        for module, name, tensor in reversed(saved):
            module._parameters[name] = tensor


def _share(
    tensor: torch.Tensor,
    name: str,
    kind: str,
    colwise: bool,
    parts: int | tuple[int, ...],
    size: int,
    rank: int,
    whole: tuple[int, ...] = (),
) -> torch.Tensor:
    """`rank`'s share of a parameter, laid out as apply_tp splits it (the dims from the one
    table, the rows as RowOrder stores them): `parts` equal fused parts or the widths of
    unequal ones, those in `whole` held by every rank."""
    dim = split_dims(kind, "colwise" if colwise else "rowwise")[name]
    assert dim is not None, f"{kind} {name} is not split"
    width = tensor.shape[dim]
    if not colwise:
        widths: tuple[int, ...] = (width,)
    elif isinstance(parts, tuple):
        widths = parts
    else:
        widths = (width // parts,) * parts
    return tensor.index_select(dim, RowOrder(dim, widths, size, whole).rank_rows(rank))


@contextlib.contextmanager
def shrunk(block: nn.Module, fixes: list[Fix]) -> Iterator[None]:
    saved = []
    try:
        for path, name, value in fixes:
            module = block.get_submodule(path)
            holder = name.split(".")[0]
            saved.append((module, holder, getattr(module, holder)))
            set_width(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
