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
tensors), and a list or an arbitrary object raises.

This module holds the contract and the file trackers; library_trackers.py holds wandb and
MLflow; tracker_set.py names them all, reads `log_with` and runs an Accelerator's trackers.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["GeneralTracker", "JSONLinesTracker", "TensorBoardTracker", "plain_value"]


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
        # `_blank` is in Accelerate's signature, and its subclasses may pass it.
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
    The run's configuration is also written to `hparams.yml`, as Accelerate does.
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
        """`add_hparams`, and, as Accelerate's tracker does, `<run>/<time.time()>/hparams.yml`
        (yaml.dump of the values: keys sorted) for tools that read the file."""
        import yaml

        hparams = {str(k): plain_value(str(k), v) for k, v in values.items()}
        self.writer.add_hparams({k: v for k, v in hparams.items() if v is not None}, {})
        self.writer.flush()
        folder = self.logging_dir / str(time.time())
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hparams.yml").write_text(yaml.dump(hparams), encoding="utf-8")

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
