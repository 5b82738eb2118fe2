"""checkpoint_blocks (`ac`): recompute repeated blocks in backward instead of keeping activations.

Contract: requires regions | provides ac | after swap_fp8, quantize_linears, insert_autocast
    | numerics exact
    | options CheckpointOptions

Policies (`ac[...]` options):
- `full` (default): every repeated block runs under non-reentrant `torch.utils.checkpoint`;
  forward keeps only each block's inputs and backward runs the block again.
- `every=N`: only every N-th repeat of each block type (the N-th, 2N-th, ...) is checkpointed.
- `selective`: op-level; the ops in recompute_rules.SAVED_OPS (matmuls, convolutions,
  attention, fp8 amax) keep their outputs, so backward recomputes only the cheap ops. Uncompiled,
  a region's graphs get selective_scope's transform (the keeping modes entered only at kept
  calls; a call with no graph runs whole under them); a compiled call runs under torch's
  `create_selective_checkpoint_contexts` around the whole block. A scoped graph with no random
  op, outside autocast, is checkpointed by graph_checkpoint.py (lighter than torch's).
- `budget=0.5` / `budget=2GB`: activations after forward must fit the budget, a fraction of what
  the model keeps without checkpointing or a size; budget.py picks none / selective / full per
  repeat at the least recompute cost. Needs example inputs (the profile below).

One form for graphs and eager code. The checkpoint wraps each chosen repeat's *call*: the pass
records a `BlockCheckpoint` in the repeat's record, and its forward (execution/checkpoint.py,
through the one RetargetedModule class) calls checkpoint around the region's call, which runs
the captured graph or, for a region no frontend captured, the eager forward. The selective policy is
decided at the dispatcher on aten ops, so it is the same op-level policy in both cases; the one
graph rewrite (selective only) routes kept calls through `run_kept`, which is the plain call
outside a selective checkpoint and while dynamo traces. Checkpointing is skipped when grad is off
(nothing is saved then) and while a region is being captured (the tracer must see the block).

Guards:
- RNG: checkpoint's `preserve_rng_state` replays the forward's RNG, so dropout masks match.
- BatchNorm: in training mode a recompute would advance running stats a second time; the
  recompute context restores them, so they advance once per step, as without checkpointing.
- Forward hooks on modules inside a checkpointed block run again during recompute when the
  block runs eagerly; the notes name them.
- A lazily captured signature is captured before the checkpoint starts, not inside it.

With example inputs, one profiled forward (activation_profile.py) predicts the activations kept
after forward with and without the plan and the FLOPs backward spends recomputing; they land in
the notes, the stats and `program.analysis` (`.activation_profile`, `.checkpoint`).

    >>> compiled = retarget.compile_for(model, "bf16+ac[budget=0.5]", example_inputs=batch)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retarget.core.module_record import record_of
from retarget.execution.checkpoint import FULL, NONE, SELECTIVE, BlockCheckpoint, block_checkpoint
from retarget.execution.kept_calls import eager_form
from retarget.execution.module_call import retarget_module
from retarget.ir.hooks import users_hook_kinds
from retarget.ir.program import Program
from retarget.passes.base import Pass, PassResult
from retarget.passes.memory.activation_profile import ActivationProfile, profile_activations
from retarget.passes.memory.budget import BudgetPlan, solve_budget
from retarget.passes.memory.measure import format_bytes
from retarget.passes.memory.selective_scope import scope_kept_calls
from retarget.targets.grammar import Target

BUDGET = "budget"
POLICY_OPTIONS = (FULL, SELECTIVE, BUDGET)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    policy: str = FULL
    """full: recompute whole blocks | selective: recompute all but SAVED_OPS | budget: choose."""
    every: int = 1
    """Checkpoint every n-th repeat of each block type (full and selective)."""
    budget: float | int | None = None
    """policy=budget: activations to keep after forward, a fraction in (0, 1] of what the model
    keeps without checkpointing, or a size in bytes."""

    def __post_init__(self):
        if self.policy not in POLICY_OPTIONS:
            raise ValueError(f"ac: policy must be one of {POLICY_OPTIONS}, not {self.policy!r}")
        if self.every < 1:
            raise ValueError(f"ac: every must be at least 1, not {self.every}")
        if (self.budget is None) != (self.policy != BUDGET):
            raise ValueError("ac: a budget goes with policy=budget only; write ac[budget=0.5]")
        if self.policy == BUDGET and self.every != 1:
            raise ValueError("ac: every applies to policy=full or selective, not to a budget")
        if isinstance(self.budget, float) and not 0 < self.budget <= 1:
            raise ValueError(f"ac: a fractional budget lies in (0, 1], not {self.budget}")


class CheckpointBlocks(Pass):
    name = "checkpoint_blocks"
    summary = "recompute repeated blocks in backward instead of keeping their activations"
    requires = ("regions",)
    provides = ("ac",)
    # The recompute runs the blocks as they finally compute: casts and fp8 modules included.
    after = ("swap_fp8", "quantize_linears", "insert_autocast")
    Options = CheckpointOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pass for the target's `ac` part; [] without one, and under pp, whose stages
        (not the region graphs) run: split_stages realises ac there."""
        part = target.get("ac")
        if part is None or "pp" in target:
            return []
        keys = ("policy", "every", "budget")
        return [cls(CheckpointOptions(**{key: part.get(key) for key in keys}))]

    def run(self, program: Program) -> PassResult:
        groups = _repeats(program)
        if not groups:
            return PassResult(changed=False, notes=(_NO_BLOCKS,))
        done = program.analysis.checkpoint
        if done is not None:  # a second run: its plan is in place (a profile now would be of it)
            note = f"already planned: ac[policy={done['policy']}]"
            return PassResult(changed=False, notes=(note,))
        _refuse_whole_graph(program)
        profile = None
        if program.example is not None:
            example = program.example
            profile = profile_activations(program.module, groups, example.args, example.kwargs)
            program.analysis.activation_profile = profile
        solved = self._solve(profile) if self.options.policy == BUDGET else None
        plan = solved.plan if solved else self._fixed_plan(groups)
        if all(policy == NONE for policy in plan.values()):
            return PassResult(changed=False, notes=(_nothing_to_do(solved, profile),))
        for path, policy in plan.items():
            if policy != NONE:
                module = program.submodule(path)
                retarget_module(module, checkpoint=block_checkpoint(module, policy))
        self._scope_selective_regions(program, plan)
        program.analysis.checkpoint = {"policy": self.options.policy, "plan": plan}
        notes = [_group_note(program, name, paths, plan) for name, paths in _by_group(groups)]
        notes += _guard_notes(program, plan)
        stats: dict[str, Any] = {"policy": self.options.policy, **_counts(plan)}
        if profile is None:
            notes.append("no example_inputs: predicted memory and recompute cost unknown")
        else:
            stats.update(_predictions(profile, plan, solved))
            notes.append(_prediction_note(stats))
        return PassResult(changed=True, stats=stats, notes=tuple(notes))

    def _fixed_plan(self, groups: dict[str, str]) -> dict[str, str]:
        policy, every = self.options.policy, self.options.every
        plan = {}
        for _, paths in _by_group(groups):
            for index, path in enumerate(paths):
                plan[path] = policy if (index + 1) % every == 0 else NONE
        return plan

    def _scope_selective_regions(self, program: Program, plan: dict[str, str]) -> None:
        """Enter the keeping modes only at kept calls in graphs of selective repeats."""
        regions = {
            id(r): r
            for p, policy in plan.items()
            if policy == SELECTIVE
            if (r := program.region_of(p)) is not None
        }
        for region in regions.values():
            region.add_transform(self.name, scope_kept_calls, eager_form=eager_form)

    def _solve(self, profile: ActivationProfile | None) -> BudgetPlan:
        budget = self.options.budget
        if profile is None:
            raise ValueError(
                f"ac[budget={budget}] needs example_inputs: the plan is chosen from the "
                "activations one forward keeps; pass example_inputs or use ac[policy=full]"
            )
        if isinstance(budget, float):
            budget = int(budget * profile.bytes())
        return solve_budget(profile, budget)


_NO_BLOCKS = (
    "no repeated block: activation checkpointing recomputes repeated blocks (find_blocks found "
    "none), and recomputing the whole model would keep nothing less; nothing checkpointed"
)


def _nothing_to_do(solved: BudgetPlan | None, profile: ActivationProfile | None) -> str:
    if solved is not None and profile is not None:
        return (
            f"budget {format_bytes(solved.budget)} holds all {format_bytes(profile.bytes())} of "
            "activations kept without checkpointing: nothing to recompute"
        )
    return "every=N exceeds the number of repeats of every block: nothing checkpointed"


def _repeats(program: Program) -> dict[str, str]:
    """Path of every repeat -> its block group's name, in module order."""
    return {path: group.name for group in program.blocks for path in group.paths}


def _by_group(groups: dict[str, str]) -> list[tuple[str, list[str]]]:
    grouped: dict[str, list[str]] = {}
    for path, name in groups.items():
        grouped.setdefault(name, []).append(path)
    return list(grouped.items())


def _refuse_whole_graph(program: Program) -> None:
    root = program.region_of("")
    if root is not None and not root.eager_only:
        raise NotImplementedError(
            "checkpoint_blocks: the whole model is one captured graph (capture='whole'), so its "
            "repeated blocks never run as modules and cannot be checkpointed one by one; "
            "use capture='regions'"
        )


# -- report ------------------------------------------------------------------------------------
def _counts(plan: dict[str, str]) -> dict[str, int]:
    return {
        "checkpointed": sum(policy != NONE for policy in plan.values()),
        "repeats": len(plan),
        "full": sum(policy == FULL for policy in plan.values()),
        "selective": sum(policy == SELECTIVE for policy in plan.values()),
    }


def _group_note(program: Program, name: str, paths: list[str], plan: dict[str, str]) -> str:
    chosen = [plan[p] for p in paths]
    counts = ", ".join(f"{chosen.count(p)} {p}" for p in (FULL, SELECTIVE) if p in chosen)
    region = program.region_of(paths[0])
    runs = "its captured graph" if region is not None and not region.eager_only else "eagerly"
    if not counts:
        return f"{name}: none of {len(paths)} repeats checkpointed"
    return (
        f"{name}: {counts} of {len(paths)} repeats checkpointed (torch.utils.checkpoint, "
        f"non-reentrant, around each call; the block runs {runs} again in backward)"
    )


def _guard_notes(program: Program, plan: dict[str, str]) -> list[str]:
    notes = []
    for path, policy in plan.items():
        if policy == NONE:
            continue
        module = program.submodule(path)
        setting: BlockCheckpoint = record_of(module).checkpoint
        if setting.batchnorms:
            notes.append(
                f"{path}: {len(setting.batchnorms)} BatchNorm running stats restored after each "
                "recompute, so they advance once per step"
            )
        hooked = [
            name
            for name, m in module.named_modules()
            if name
            and {"forward hook", "forward pre-hook"}
            & set(users_hook_kinds(m, program.parked_hooks))
        ]
        # A user hook inside a block makes its region run eagerly (ir/hooks.py), so the
        # recompute calls the hook again whether or not the block was captured.
        if hooked:
            notes.append(
                f"{path}: forward hooks on {', '.join(hooked)} run again when backward "
                "recomputes the block"
            )
    return notes


def _predictions(
    profile: ActivationProfile, plan: dict[str, str], solved: BudgetPlan | None
) -> dict[str, Any]:
    blocks = profile.blocks
    predicted = {
        "activations_before": profile.bytes(),
        "activations_after": profile.bytes(plan),
        "recompute_transient": profile.transient(plan),
        "recompute_flops": sum(b.recompute_flops(plan[p]) for p, b in blocks.items()),
        "recompute_elements": sum(b.recompute_elements(plan[p]) for p, b in blocks.items()),
    }
    if solved is not None:
        predicted.update(budget=solved.budget, floor=solved.floor)
    return predicted


def _prediction_note(stats: dict[str, Any]) -> str:
    before, after = stats["activations_before"], stats["activations_after"]
    budget = f" (budget {format_bytes(stats['budget'])})" if "budget" in stats else ""
    return (
        f"predicted activations after forward: {format_bytes(before)} -> {format_bytes(after)} "
        f"({after / before:.0%}){budget}; backward recomputes {stats['recompute_flops']:,} "
        f"matmul FLOPs and {stats['recompute_elements']:,} elements of cheap ops, holding up to "
        f"{format_bytes(stats['recompute_transient'])} more while one block is recomputed"
    )
