"""Errors raised by retarget, by who has to act on them.

User mistakes are ValueError subclasses that name the field and the fix (`TargetError` lives
in `retarget.targets.grammar`); a pass that cannot handle what it was given raises `PassError`
naming the pass and the passes that ran before it; a requested target part that no pass
implements yet is refused with `TargetNotSupportedError` rather than silently skipped.
"""

from __future__ import annotations


class PassError(RuntimeError):
    """A pass failed. The message names the pass and the passes that ran before it."""

    def __init__(self, pass_name: str, ran_before: list[str], cause: BaseException | str):
        self.pass_name = pass_name
        self.ran_before = list(ran_before)
        before = ", ".join(ran_before) if ran_before else "nothing"
        super().__init__(f"pass '{pass_name}' failed (after: {before}): {cause}")


class VerificationError(PassError):
    """Verification after a pass found a broken invariant (lint, state_dict keys or numerics)."""


class PassOrderError(ValueError):
    """A pass list breaks a declaration: a requirement unmet or met later, an `after` pass later."""


class EagerRegionWarning(UserWarning):
    """A region (or one of its call signatures) runs its eager form instead of its graph."""


class TargetNotSupportedError(NotImplementedError):
    """A valid target part has no pass implementing it (yet): refused, never silently dropped."""


class UncompiledRegionWarning(UserWarning):
    """A region asked to be compiled (the `compile` part) runs uncompiled: its compile failed."""


class CheckpointError(ValueError):
    """Saved state that cannot be loaded as asked: a save_state folder that is missing,
    incomplete, damaged or of another run, or weight files that do not fit the model (the
    message names the folder, file or key, and what to do)."""


class RegionCompileError(RuntimeError):
    """compile[fullgraph=true]: a region did not compile as one graph. Names the region."""
