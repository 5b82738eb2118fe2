"""Trackers that log through their own libraries: Weights & Biases, MLflow and Comet.

Both follow Accelerate's tracker of the same name (its init kwargs, its `tracker` object, its
log_images/log_table for wandb), but a value the service cannot record raises naming its key
where Accelerate drops it with a warning. The packages are imported when a tracker is created,
never when retarget is: a bare `pip install retarget` does without them.

    >>> accelerator = Accelerator(log_with=["wandb", "mlflow"])
    >>> accelerator.init_trackers(
    ...     "mnist", config={"lr": 1e-3},
    ...     init_kwargs={"wandb": {"mode": "offline", "dir": "runs"},
    ...                  "mlflow": {"run_name": "first"}})

Offline use: wandb runs without a server in `mode="offline"` (or WANDB_MODE=offline) and keeps
the run under `<dir>/wandb/offline-run-*` for `wandb sync` (its service may still be writing
the .wandb file after Run.finish returns: `wandb.teardown()` waits for it). MLflow needs no
server with a `file:` or `sqlite:` MLFLOW_TRACKING_URI (recent MLflow asks for
MLFLOW_ALLOW_FILE_STORE=true before it opens a `file:` store). Comet runs offline with
COMET_START_ONLINE=false (or `online=False`) and writes a zip under COMET_OFFLINE_DIRECTORY for
`comet upload`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from retarget.compat.accelerate.trackers import GeneralTracker, plain_value

__all__ = ["CometMLTracker", "MLflowTracker", "WandBTracker"]


def _import(package: str, tracker: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise ImportError(
            f"log_with={tracker!r} needs the {package} package: pip install 'retarget[trackers]'"
        ) from err


class WandBTracker(GeneralTracker):
    """A Weights & Biases run: `wandb.init(project=run_name, **kwargs)` on the main process.

    Numbers, strings, one-element tensors, dicts of those and wandb media objects (wandb.Image,
    wandb.Table, ...) are logged; `store_init_configuration` updates the run's config. The
    `tracker` is the wandb Run.
    """

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self._wandb = _import("wandb", self.name)
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        """The wandb Run (None before start)."""
        return self.run

    def start(self) -> None:
        self.run = self._wandb.init(project=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        config = {str(k): self._value(str(k), v) for k, v in values.items()}
        self.run.config.update(config, allow_val_change=True)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """`values` at `step`; kwargs go to `Run.log` (e.g. `commit=False`)."""
        self.run.log({str(k): self._value(str(k), v) for k, v in values.items()}, step, **kwargs)

    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any):
        """Lists of images (numpy arrays or PIL images) under each key, as wandb.Image."""
        images = {k: [self._wandb.Image(image) for image in v] for k, v in values.items()}
        self.log(images, step=step, **kwargs)

    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """A wandb.Table from `columns` and `data` rows, or from a pandas `dataframe`."""
        table = self._wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.log({table_name: table}, step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    def _value(self, key: str, value: Any) -> Any:
        from wandb.sdk.data_types.base_types.wb_value import WBValue

        if isinstance(value, WBValue):
            return value
        if (
            isinstance(value, (list, tuple))
            and value
            and all(isinstance(v, WBValue) for v in value)
        ):
            return list(value)
        if isinstance(value, Mapping):
            return {str(k): self._value(f"{key}.{k}", v) for k, v in value.items()}
        return plain_value(key, value)


class MLflowTracker(GeneralTracker):
    """An MLflow run in experiment `experiment_name` (the project name), made on start.

    Keyword arguments are Accelerate's (`logging_dir` is the experiment's artifact location,
    `run_id` resumes a run; `tags`, `nested_run`, `run_name`, `description`); where the run is
    stored is MLflow's own setting (MLFLOW_TRACKING_URI or `mlflow.set_tracking_uri`). Metrics
    are numbers: a dict logs one metric per entry as `key/entry`;
    a string raises (log text with `mlflow.log_text`). Parameters longer than MLflow accepts
    raise naming the key. The `tracker` is the mlflow ActiveRun.
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str,
        logging_dir: str | os.PathLike[str] | None = None,
        *,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        super().__init__()
        self._mlflow = _import("mlflow", self.name)
        self.experiment_name = experiment_name
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.run_id, self.tags = run_id, dict(tags or {})
        self.nested_run, self.run_name, self.description = nested_run, run_name, description
        self.active_run: Any = None

    @property
    def tracker(self) -> Any:
        """The mlflow ActiveRun (None before start)."""
        return self.active_run

    def start(self) -> None:
        mlflow = self._mlflow
        experiment = mlflow.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = mlflow.create_experiment(
                self.experiment_name, artifact_location=self.logging_dir, tags=self.tags
            )
        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=experiment_id,
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {str(k): str(plain_value(str(k), v)) for k, v in values.items()}
        too_long = [k for k, v in params.items() if len(v) > MAX_PARAM_VAL_LENGTH]
        if too_long:
            raise ValueError(
                f"cannot store {too_long} as MLflow parameters: longer than "
                f"{MAX_PARAM_VAL_LENGTH} characters; log them with mlflow.log_text instead"
            )
        items = list(params.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._mlflow.log_params(dict(items[start : start + MAX_PARAMS_TAGS_PER_BATCH]))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """`values` as metrics at `step`; kwargs go to `mlflow.log_metrics`."""
        metrics: dict[str, float] = {}
        for key, value in values.items():
            group = value if isinstance(value, Mapping) else {None: value}
            for sub, item in group.items():
                name = str(key) if sub is None else f"{key}/{sub}"
                metrics[name] = _metric(name, item)
        self._mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        if self.active_run is not None:
            self._mlflow.end_run()
            self.active_run = None


def _metric(key: str, value: Any) -> float:
    plain = plain_value(key, value)
    if plain is None or isinstance(plain, str):
        raise TypeError(
            f"cannot log {key!r} to MLflow: a {type(plain).__name__}, and MLflow metrics are "
            "numbers (log text through the run: mlflow.log_text)"
        )
    return float(plain)


class CometMLTracker(GeneralTracker):
    """A Comet experiment: `comet_ml.start(project_name=run_name, **kwargs)` on the main process.

    Numbers are metrics (a dict logs each entry as `key/entry`), strings go to `log_other`,
    the configuration to `log_parameters`. The `tracker` is the comet Experiment (an
    OfflineExperiment when offline).
    """

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self._comet = _import("comet_ml", self.name)
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The comet Experiment (None before start)."""
        return self.writer

    def start(self) -> None:
        self.writer = self._comet.start(project_name=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.writer.log_parameters({str(k): plain_value(str(k), v) for k, v in values.items()})

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """`values` at `step`; kwargs go to `log_metric` / `log_other`."""
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            group = value if isinstance(value, Mapping) else {None: value}
            for sub, item in group.items():
                name = str(key) if sub is None else f"{key}/{sub}"
                plain = plain_value(name, item)
                if isinstance(plain, str):
                    self.writer.log_other(name, plain, **kwargs)
                elif plain is None:
                    raise TypeError(f"cannot log {name!r} to Comet: None is not a metric")
                else:
                    self.writer.log_metric(name, plain, step=step, **kwargs)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.end()
            self.writer = None
