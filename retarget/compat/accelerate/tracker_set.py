"""An Accelerator's trackers: `log_with` read into tracker names and instances, and the set of
trackers each process creates, feeds and closes (named ones on the main process only).

A named tracker whose package is not installed, and Accelerate's tracker names that retarget
does not wire in, are refused by name with the reason; "all" is every named tracker that can
run here.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Mapping
from typing import Any

from retarget.compat.accelerate.library_trackers import CometMLTracker, MLflowTracker, WandBTracker
from retarget.compat.accelerate.trackers import GeneralTracker, JSONLinesTracker, TensorBoardTracker

__all__ = ["TRACKERS", "UNSUPPORTED_TRACKERS", "TrackerSet", "resolve_log_with"]

#: The trackers `log_with` can name, with the package each needs (None: nothing beyond torch).
TRACKERS: dict[str, tuple[type[GeneralTracker], str | None]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard"),
    "jsonl": (JSONLinesTracker, None),
    "wandb": (WandBTracker, "wandb"),
    "mlflow": (MLflowTracker, "mlflow"),
    "comet_ml": (CometMLTracker, "comet_ml"),
}

#: Accelerate's tracker names that retarget does not wire in, with why.
UNSUPPORTED_TRACKERS = {
    "aim": "an Aim repository (not wired into retarget; aim 3.29 also downgrades filelock)",
    "clearml": "a ClearML server (its offline mode is not wired into retarget: Task.init patches "
    "torch process-wide)",
    "dvclive": "DVC, dozens of packages (not wired into retarget)",
    "swanlab": "the SwanLab service, and its package pins an older protobuf",
    "trackio": "the Trackio service (not wired into retarget)",
}


def _installed(package: str | None) -> bool:
    return package is None or importlib.util.find_spec(package) is not None


def _told_where_to_log(name: str) -> bool:
    # "all" must not stall a script on a login prompt or write where nobody asked: wandb joins
    # when it runs offline or has a key, MLflow when it has a tracking URI, Comet when offline
    # or with a key.
    env = {k: v.lower() for k, v in os.environ.items() if k.startswith(("WANDB_", "COMET_"))}
    if name == "wandb":
        return env.get("WANDB_MODE") in ("offline", "dryrun", "disabled") or "WANDB_API_KEY" in env
    if name == "comet_ml":
        return env.get("COMET_START_ONLINE") in ("false", "0") or "COMET_API_KEY" in env
    if name == "mlflow":
        return bool(os.environ.get("MLFLOW_TRACKING_URI"))
    return True


class _BlankTracker(GeneralTracker):
    """What get_tracker returns on a process that holds no trackers: every call does nothing."""

    name = "blank"
    requires_logging_directory = False

    @property
    def tracker(self) -> None:
        return None


def _tracker_name(spec: Any) -> str:
    # Accelerate's LoggerType is a str enum: its value is the name.
    value = getattr(spec, "value", spec)
    if not isinstance(value, str):
        raise TypeError(
            f"log_with takes tracker names or GeneralTracker instances, got {type(spec).__name__}"
        )
    return value.strip().lower()


_TRACKER_METHODS = ("start", "store_init_configuration", "log", "finish")


def _is_tracker(obj: Any) -> bool:
    # Accelerate's own GeneralTracker subclasses follow the same contract: accept them too.
    return hasattr(obj, "name") and all(callable(getattr(obj, m, None)) for m in _TRACKER_METHODS)


def resolve_log_with(log_with: Any) -> list[str | GeneralTracker]:
    """`log_with` as a list of tracker names and instances; unknown or unsupported names raise.

    "all" means every named tracker that can run here: its package is installed and, for wandb,
    MLflow and Comet, the environment says where to log (WANDB_MODE=offline or WANDB_API_KEY;
    MLFLOW_TRACKING_URI; COMET_START_ONLINE=false or COMET_API_KEY). A tracker named on its
    own whose package is missing raises.
    """
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    resolved: list[str | GeneralTracker] = []
    for item in items:
        if _is_tracker(item):
            resolved.append(item)
            continue
        name = _tracker_name(item)
        if name == "all":
            resolved += [
                n for n, (_, pkg) in TRACKERS.items() if _installed(pkg) and _told_where_to_log(n)
            ]
        elif name in TRACKERS:
            package = TRACKERS[name][1]
            if not _installed(package):
                raise ValueError(
                    f"log_with={name!r} needs the {package} package, which is not installed: "
                    "pip install 'retarget[trackers]'"
                )
            resolved.append(name)
        elif name in UNSUPPORTED_TRACKERS:
            raise ValueError(
                f"log_with={name!r} is not supported: it needs {UNSUPPORTED_TRACKERS[name]}. "
                f"Use {', '.join(map(repr, TRACKERS))}, or pass an instance of a "
                "GeneralTracker subclass that wraps it"
            )
        else:
            raise ValueError(
                f"log_with={name!r} is not a tracker: use {', '.join(map(repr, TRACKERS))}, "
                "'all', or a GeneralTracker instance"
            )
    names = [r for r in resolved if isinstance(r, str)]
    return [r for i, r in enumerate(resolved) if not isinstance(r, str) or r not in names[:i]]


class TrackerSet:
    """The trackers of one Accelerator: created by `init`, fed by `log`, closed by `finish`.

    Named trackers and trackers with `main_process_only` run on the main process only; a
    process that holds none gets a blank tracker from `get` (every call a no-op), as in
    Accelerate.
    """

    def __init__(
        self, log_with: Any, logging_dir: str | os.PathLike[str] | None, is_main_process: bool
    ) -> None:
        self.specs = resolve_log_with(log_with)
        self.logging_dir = logging_dir
        self.is_main_process = is_main_process
        self.trackers: list[Any] = []
        # Instances were built by the caller with their own paths; named trackers need ours.
        needs_dir = [
            s
            for s in self.specs
            if isinstance(s, str) and TRACKERS[s][0].requires_logging_directory
        ]
        if needs_dir and logging_dir is None:
            raise ValueError(
                f"log_with {needs_dir} writes files but no logging directory is set: pass "
                "project_dir= (or project_config=ProjectConfiguration(logging_dir=...))"
            )

    def init(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Create and start the trackers of this process; store `config` in each."""
        init_kwargs = dict(init_kwargs or {})
        names = {s if isinstance(s, str) else s.name for s in self.specs}
        unknown = sorted(set(init_kwargs) - names)
        if unknown:
            raise ValueError(
                f"init_kwargs names {unknown}, which are not in log_with ({sorted(names)})"
            )
        for spec in self.specs:
            if isinstance(spec, str):
                if self.is_main_process:
                    self.trackers.append(self._create(spec, project_name, init_kwargs))
            elif self.is_main_process or not getattr(spec, "main_process_only", True):
                self.trackers.append(spec)
        for tracker in self.trackers:
            tracker.start()
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def _create(self, name: str, project_name: str, init_kwargs: Mapping[str, Any]) -> Any:
        # As Accelerate: only trackers that write under the logging directory are given it.
        tracker_class, kwargs = TRACKERS[name][0], init_kwargs.get(name, {})
        if tracker_class.requires_logging_directory:
            return tracker_class(project_name, self.logging_dir, **kwargs)
        return tracker_class(project_name, **kwargs)

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """`values` to every tracker of this process."""
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called `name` (its underlying object with `unwrap`)."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if self.trackers or name not in self._names():
            raise ValueError(
                f"no tracker named {name!r}: this Accelerator logs with {self._names() or 'none'}"
            )
        return _BlankTracker()

    def _names(self) -> list[str]:
        return [s if isinstance(s, str) else s.name for s in self.specs]

    def finish(self) -> None:
        """Close every tracker of this process."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.trackers)
