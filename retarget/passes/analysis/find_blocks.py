"""find_blocks: the module tree as networkx, and its repeated blocks by structural hashing.

Contract: requires - | provides tree, blocks | after - | numerics exact | options FindBlocksOptions

A module's fingerprint hashes its class, its own parameters and buffers (name, shape, dtype,
requires_grad), its plain scalar attributes and its children's fingerprints. Modules with
children and parameters whose fingerprint occurs more than once are the repeats of one block;
only the outermost repeats count (a decoder layer, not the Linears inside it). Index-like
attributes (`layer_idx` ...) are left out of the fingerprint so that layers differing only in
their position still share one graph; capture re-checks that sharing on the last repeat.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import networkx as nx
from torch import nn

from retarget.core.modules import original_class
from retarget.ir.program import BlockGroup, Program
from retarget.passes.base import Pass, PassResult
from retarget.targets.grammar import Target

#: Attributes that name a module's position rather than what it computes.
POSITION_ATTRIBUTES = frozenset(
    {"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"}
)
#: Containers that are never called, so never a block.
NOT_CALLABLE = (nn.ModuleList, nn.ModuleDict)
_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True, kw_only=True)
class FindBlocksOptions:
    min_repeats: int = 2
    """A structure must occur at least this often to be a repeated block."""


class FindBlocks(Pass):
    name = "find_blocks"
    reads_graphs = False
    summary = "module tree as networkx; repeated blocks by structural hashing"
    provides = ("tree", "blocks")
    Options = FindBlocksOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """Every target: the tree and the repeated blocks decide what becomes a region."""
        return [cls()]

    def run(self, program: Program) -> PassResult:
        fingerprints: dict[int, str] = {}
        program.tree = module_tree(program.module, fingerprints)
        program.blocks = repeated_blocks(program.module, fingerprints, self.options.min_repeats)
        stats = {
            "modules": program.tree.number_of_nodes(),
            "block_types": len(program.blocks),
            "blocks": sum(len(g.paths) for g in program.blocks),
        }
        notes = tuple(f"{g.name}: {len(g.paths)} x {g.block_type}" for g in program.blocks)
        return PassResult(changed=False, stats=stats, notes=notes or ("no repeated blocks",))


def fingerprint(module: nn.Module, memo: dict[int, str]) -> str:
    """Structural hash of a module (memoised by object id)."""
    if id(module) in memo:
        return memo[id(module)]
    parts = [original_class(module).__qualname__]
    for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
        if tensor is not None:
            parts.append(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.requires_grad}")
    for key, value in sorted(vars(module).items()):
        if (
            isinstance(value, _SCALARS)
            and not key.startswith("_")
            and key not in POSITION_ATTRIBUTES
        ):
            parts.append(f"{key}={value!r}")
    for name, child in module._modules.items():
        parts.append(f"{name}->{fingerprint(child, memo) if child is not None else None}")
    digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
    memo[id(module)] = digest
    return digest


def module_tree(root: nn.Module, memo: dict[int, str]) -> nx.DiGraph:
    """One node per module path ("" is the root) with class and parameter counts."""
    tree = nx.DiGraph()
    for path, module in root.named_modules(remove_duplicate=False):
        own = sum(p.numel() for p in module.parameters(recurse=False))
        tree.add_node(
            path,
            cls=original_class(module).__name__,
            params=own,
            total_params=sum(p.numel() for p in module.parameters()),
            shapes={n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)},
            fingerprint=fingerprint(module, memo),
        )
        if path:
            tree.add_edge(path.rpartition(".")[0], path)
    return tree


def repeated_blocks(root: nn.Module, memo: dict[int, str], min_repeats: int) -> list[BlockGroup]:
    """Outermost groups of structurally equal, callable, parameterised modules."""
    candidates: dict[str, list[tuple[str, nn.Module]]] = {}
    for path, module in root.named_modules():
        if path and module._modules and not isinstance(module, NOT_CALLABLE):
            if any(True for _ in module.parameters()):
                candidates.setdefault(fingerprint(module, memo), []).append((path, module))
    groups = [members for members in candidates.values() if len(members) >= min_repeats]
    groups.sort(key=lambda members: members[0][0].count("."))
    chosen: list[BlockGroup] = []
    taken: list[str] = []
    for members in groups:
        paths = [p for p, _ in members if not any(_inside(p, t) for t in taken)]
        if len(paths) < min_repeats:
            continue
        taken.extend(paths)
        module = members[0][1]
        chosen.append(
            BlockGroup(
                block_type=original_class(module).__name__,
                paths=paths,
                fingerprint=fingerprint(module, memo),
                parameters=sum(p.numel() for p in module.parameters()),
            )
        )
    chosen.sort(key=lambda group: list(dict(root.named_modules())).index(group.paths[0]))
    return chosen


def _inside(path: str, ancestor: str) -> bool:
    return path == ancestor or path.startswith(ancestor + ".")
