"""Experiment trackers behind `Accelerator(log_with=...)`: TensorBoard, JSON lines, your own.

Accelerate's tracker contract, kept so its scripts and custom trackers work unchanged: a tracker
has a `name`, says whether it `requires_logging_directory`, and implements `start()`,
`store_init_configuration(values)`, `log(values, step=None, **kwargs)`, `finish()` and a
`tracker` property (the underlying object, e.g. the SummaryWriter).

    >>> accelerator = Accelerator(log_with=["tensorboard", "jsonl"], project_dir="runs")
    >>> accelerator.init_trackers("mnist", config={"lr": 1e-3})
    >>> accelerator.log({"loss": loss, "epoch": epoch}, step=step)   # main process only
    >>> accelerator.end_training()

Unlike Accelerate, a value a tracker cannot record is an error naming its key, never dropped:
a one-element tensor is logged as its number (Accelerate's TensorBoard tracker silently skips
tensors), and a list or an arbitrary object raises. Trackers that need services we do not ship
(wandb, mlflow, ...) are refused by name; wrap them in a `GeneralTracker` subclass instead.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "GeneralTracker",
    "JSONLinesTracker",
    "TensorBoardTracker",
    "TrackerSet",
    "UNSUPPORTED_TRACKERS",
]

#: Accelerate's tracker names that retarget does not ship, with what each would need.
UNSUPPORTED_TRACKERS = {
    "wandb": "the Weights & Biases service",
    "comet_ml": "the Comet service",
    "aim": "an Aim repository server",
    "mlflow": "an MLflow tracking server",
    "clearml": "the ClearML service",
    "dvclive": "DVC",
    "swanlab": "the SwanLab service",
    "trackio": "the Trackio service",
}


class GeneralTracker:
    """Base class of a tracker; subclass it for your own (Accelerate's contract).

    A subclass sets `name` and `requires_logging_directory` (class attributes) and defines the
    `tracker` property; it overrides what it needs of `start`, `store_init_configuration`,
    `log` and `finish`. With `main_process_only = False` it runs on every process.

        >>> class PrintTracker(GeneralTracker):
        ...     name, requires_logging_directory = "print", False
        ...     @property
        ...     def tracker(self): return None
        ...     def log(self, values, step=None, **kwargs): print(step, values)
        >>> Accelerator(log_with=PrintTracker())
    """

    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [
            attr
            for attr in ("name", "requires_logging_directory", "tracker")
            if not hasattr(type(self), attr)
        ]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} is missing {', '.join(missing)}: a tracker class "
                "defines `name` and `requires_logging_directory` as class attributes and a "
                "`tracker` property"
            )

    def start(self) -> None:
        """Open the run (called by init_trackers, after the process group exists)."""

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record `values` (at `step` when given)."""

    def finish(self) -> None:
        """Close the run: flush and release files or connections."""


class _BlankTracker(GeneralTracker):
    """What get_tracker returns on a process that holds no trackers: every call does nothing."""

    name = "blank"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__(_blank=True)

    @property
    def tracker(self) -> None:
        return None


def plain_value(key: str, value: Any) -> int | float | str | bool | None:
    """`value` as a number, string, bool or None; a one-element tensor becomes its number."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"cannot log {key!r}: a tensor of shape {tuple(value.shape)}; log one number "
                "per key (e.g. value.mean().item())"
            )
        return value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"cannot log {key!r}: a {type(value).__name__}; trackers take numbers, strings, bools, "
        "one-element tensors and dicts of numbers"
    )


class JSONLinesTracker(GeneralTracker):
    """One JSON object per `log` call in `<logging_dir>/<run_name>/log.jsonl`.

    Each line is `{"step": step, "time": seconds since the epoch, "values": {...}}`; nested
    dicts of numbers are kept as dicts. `store_init_configuration` writes `config.json`.
    Lines are flushed as they are written, so the file can be read while training runs.
    """

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self.path = self.logging_dir / "log.jsonl"
        self._file: Any = None

    @property
    def tracker(self) -> Any:
        """The open log file (None before start or after finish)."""
        return self._file

    def start(self) -> None:
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        config = {str(k): _json_value(str(k), v) for k, v in values.items()}
        (self.logging_dir / "config.json").write_text(json.dumps(config, indent=1))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if self._file is None:
            raise RuntimeError("JSONLinesTracker.log before start(): call init_trackers first")
        if kwargs:
            raise TypeError(f"the jsonl tracker takes no log options, got {sorted(kwargs)}")
        record = {
            "step": step,
            "time": time.time(),
            "values": {str(k): _json_value(str(k), v) for k, v in values.items()},
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _json_value(key: str, value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_value(f"{key}.{k}", v) for k, v in value.items()}
    plain = plain_value(key, value)
    if isinstance(plain, float) and not math.isfinite(plain):
        return str(plain)  # JSON has no inf/nan; keep the fact, readable by float()
    return plain


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files in `<logging_dir>/<run_name>` (torch.utils.tensorboard).

    Numbers and one-element tensors become scalars, strings text, a dict of numbers one
    `add_scalars` group; hyperparameters go through `add_hparams`. Needs the `tensorboard`
    package. Extra keyword arguments go to SummaryWriter (`init_kwargs={"tensorboard": {...}}`).
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch imports tensorboard lazily, here
            raise ImportError(
                "log_with='tensorboard' needs the tensorboard package: pip install tensorboard"
            ) from err
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self._writer_class, self._writer_kwargs = SummaryWriter, kwargs
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The SummaryWriter (None before start)."""
        return self.writer

    def start(self) -> None:
        self.writer = self._writer_class(str(self.logging_dir), **self._writer_kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        hparams = {str(k): plain_value(str(k), v) for k, v in values.items()}
        self.writer.add_hparams({k: v for k, v in hparams.items() if v is not None}, {})
        self.writer.flush()

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            key = str(key)
            if isinstance(value, Mapping):
                group = {str(k): plain_value(f"{key}.{k}", v) for k, v in value.items()}
                if not all(isinstance(v, (int, float)) for v in group.values()):
                    raise TypeError(f"cannot log {key!r}: a dict must hold numbers only")
                self.writer.add_scalars(key, group, global_step=step, **kwargs)
                continue
            plain = plain_value(key, value)
            if isinstance(plain, str):
                self.writer.add_text(key, plain, global_step=step, **kwargs)
            elif plain is None:
                raise TypeError(f"cannot log {key!r}: None is not a scalar")
            else:
                self.writer.add_scalar(key, plain, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


#: The trackers `log_with` can name.
TRACKERS: dict[str, type[GeneralTracker]] = {
    "tensorboard": TensorBoardTracker,
    "jsonl": JSONLinesTracker,
}


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

    "all" means every tracker retarget ships (tensorboard when installed, jsonl).
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
            resolved += [n for n in TRACKERS if n != "tensorboard" or _has_tensorboard()]
        elif name in TRACKERS:
            resolved.append(name)
        elif name in UNSUPPORTED_TRACKERS:
            raise ValueError(
                f"log_with={name!r} is not supported: it needs {UNSUPPORTED_TRACKERS[name]}, "
                f"which retarget does not ship. Use {' or '.join(map(repr, TRACKERS))}, or pass "
                "an instance of a GeneralTracker subclass that wraps it"
            )
        else:
            raise ValueError(
                f"log_with={name!r} is not a tracker: use {', '.join(map(repr, TRACKERS))}, "
                "'all', or a GeneralTracker instance"
            )
    names = [r for r in resolved if isinstance(r, str)]
    return [r for i, r in enumerate(resolved) if not isinstance(r, str) or r not in names[:i]]


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


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
            s for s in self.specs if isinstance(s, str) and TRACKERS[s].requires_logging_directory
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
                    kwargs = init_kwargs.get(spec, {})
                    self.trackers.append(TRACKERS[spec](project_name, self.logging_dir, **kwargs))
            elif self.is_main_process or not getattr(spec, "main_process_only", True):
                self.trackers.append(spec)
        for tracker in self.trackers:
            tracker.start()
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

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
