"""Choose what to recompute so activations fit a budget, at the least recompute cost.

The model. Each repeat `k` of a repeated block takes one of three policies, with what it keeps
after forward (from an ActivationProfile) and what backward then spends recomputing:

    none       keeps what autograd saves inside the block          costs nothing
    selective  keeps its inputs and its matmul/attention outputs   costs its cheap ops again
    full       keeps its inputs                                    costs the whole block again

Block inputs are resident under every policy (a checkpoint holds them; without one the block,
or the block before it, saves them), and so is what the glue keeps. Those form the fixed part,
which is also the floor: no plan goes below it. What a repeat adds on top of the fixed part,
`m_k(p)`, does not depend on the other repeats' policies, so the problem is a multiple-choice
knapsack: pick one policy per repeat, minimising sum cost_k(p_k) subject to
fixed + sum m_k(p_k) <= budget. Cost is FLOPs (torch.utils.flop_counter's count of matmul-class
ops) plus one per element the other ops write, so a recomputed norm is cheap but not free.

We solve it exactly, up to the memory resolution, as a shortest path in a layered DAG built with
networkx: node (k, u) means the first k repeats use u memory units; an edge per policy of repeat
k goes to (k + 1, u + units(m_k(p))) and weighs cost_k(p); every node of the last layer links to
the sink. Units are budget/RESOLUTION rounded up, so the plan found never exceeds the budget and
is at most one unit per repeat more conservative than the exact optimum. The graph has at most
(repeats + 1) * (RESOLUTION + 1) nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from retarget.execution.checkpoint import FULL, POLICIES
from retarget.passes.memory.activation_profile import ActivationProfile

#: Memory units the budget is cut into.
RESOLUTION = 512
_SOURCE, _SINK = "source", "sink"


class BudgetError(ValueError):
    """The budget cannot be met: it is below what every plan keeps."""


@dataclass(frozen=True)
class BudgetPlan:
    """A policy per repeat, with what it is predicted to keep and to cost."""

    plan: dict[str, str]
    budget: int
    floor: int
    predicted: int
    recompute_flops: int
    recompute_elements: int


def cost(profile: ActivationProfile, path: str, policy: str) -> int:
    """The solver's recompute cost of one repeat under `policy` (see the module docstring)."""
    block = profile.blocks[path]
    return block.recompute_flops(policy) + block.recompute_elements(policy)


def floor_bytes(profile: ActivationProfile) -> int:
    """The least activation memory any plan keeps: every repeat fully checkpointed."""
    return profile.bytes(dict.fromkeys(profile.blocks, FULL))


def solve_budget(profile: ActivationProfile, budget: int) -> BudgetPlan:
    """The least-cost plan whose predicted activations fit `budget` bytes."""
    floor = floor_bytes(profile)
    if budget < floor:
        total = profile.bytes()
        raise BudgetError(
            f"activation budget {budget:,} bytes is below the minimum {floor:,} bytes "
            f"({floor / total:.2f} of the {total:,} bytes kept without checkpointing): every "
            f"block fully recomputed still keeps its inputs and the glue's activations; "
            f"use ac[budget={math.ceil(floor / total * 100) / 100}] or more"
        )
    fixed = profile.resident(dict.fromkeys(profile.blocks, FULL))
    extra = {
        path: {
            policy: sum(v for k, v in block.keeps(policy).items() if k not in fixed)
            for policy in POLICIES
        }
        for path, block in profile.blocks.items()
    }
    plan = _shortest_plan(profile, extra, budget - sum(fixed.values()))
    return BudgetPlan(
        plan=plan,
        budget=budget,
        floor=floor,
        predicted=profile.bytes(plan),
        recompute_flops=sum(b.recompute_flops(plan[p]) for p, b in profile.blocks.items()),
        recompute_elements=sum(b.recompute_elements(plan[p]) for p, b in profile.blocks.items()),
    )


def _shortest_plan(
    profile: ActivationProfile, extra: dict[str, dict[str, int]], capacity: int
) -> dict[str, str]:
    unit = max(capacity, 1) / RESOLUTION
    paths = list(extra)
    graph = nx.DiGraph()
    layer = {0}
    for k, path in enumerate(paths):
        following: set[int] = set()
        for used in layer:
            for policy, size in extra[path].items():
                after = used + math.ceil(size / unit)
                if after > RESOLUTION:
                    continue
                weight = cost(profile, path, policy)
                head = (k + 1, after)
                edge = graph.get_edge_data((k, used), head)
                if edge is None or edge["weight"] > weight:
                    graph.add_edge((k, used), head, weight=weight, policy=policy)
                following.add(after)
        layer = following
    for used in layer:
        graph.add_edge((len(paths), used), _SINK, weight=0, policy=None)
    graph.add_edge(_SOURCE, (0, 0), weight=0, policy=None)
    route = nx.shortest_path(graph, _SOURCE, _SINK, weight="weight")
    chosen = [graph.edges[a, b]["policy"] for a, b in zip(route[1:-2], route[2:-1], strict=True)]
    plan = dict(zip(paths, chosen, strict=True))
    assert all(policy in POLICIES for policy in plan.values()), plan
    return plan
