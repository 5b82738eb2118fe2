"""Trackers: JSON lines and TensorBoard files hold what was logged; custom trackers get the calls;
unsupported names and values that cannot be recorded are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from retarget.compat.accelerate.tracker_set import (
    TRACKERS,
    UNSUPPORTED_TRACKERS,
    TrackerSet,
    resolve_log_with,
)
from retarget.compat.accelerate.trackers import GeneralTracker, JSONLinesTracker, TensorBoardTracker


class ListTracker(GeneralTracker):
    """A custom tracker that keeps every call, as a user's wandb wrapper would forward them."""

    name = "list"
    requires_logging_directory = False

    def __init__(self, main_process_only: bool = True):
        super().__init__()
        self.main_process_only = main_process_only
        self.calls: list[tuple] = []

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append(("start",))

    def store_init_configuration(self, values):
        self.calls.append(("config", dict(values)))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", dict(values), step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


def scalars(folder):
    """{tag: [(step, value)]} read back from the TensorBoard event files under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_jsonl_file_holds_logged_values(tmp_path):
    trackers = TrackerSet("jsonl", tmp_path, is_main_process=True)
    trackers.init("run", config={"lr": 0.1, "epochs": 2})
    trackers.log({"loss": torch.tensor(0.5), "epoch": 1, "name": "a"}, step=3)
    trackers.log({"loss": 0.25, "nested": {"a": 1.0}}, step=4)
    trackers.finish()
    lines = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["values"]) for r in lines] == [
        (3, {"loss": 0.5, "epoch": 1, "name": "a"}),
        (4, {"loss": 0.25, "nested": {"a": 1.0}}),
    ]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.1, "epochs": 2}


def test_tensorboard_event_files_hold_logged_scalars(tmp_path):
    trackers = TrackerSet("tensorboard", tmp_path, is_main_process=True)
    trackers.init("run", config={"lr": 0.1})
    for step, loss in enumerate([1.5, 1.0, 0.75]):
        trackers.log({"loss": torch.tensor(loss), "acc": step / 4}, step=step)
    writer = trackers.get("tensorboard", unwrap=True)
    assert type(writer).__name__ == "SummaryWriter"
    trackers.finish()
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))
    read = scalars(tmp_path / "run")
    assert read["loss"] == [(0, 1.5), (1, 1.0), (2, 0.75)]
    assert read["acc"] == [(0, 0.0), (1, 0.25), (2, 0.5)]


def test_tensorboard_writes_the_configuration_to_hparams_yml_as_accelerate_does(tmp_path):
    import yaml

    config = {"lr": 3e-4, "epochs": 3, "model": "tiny", "seed": None, "scale": torch.tensor(2.0)}
    trackers = TrackerSet("tensorboard", tmp_path / "ours", is_main_process=True)
    trackers.init("run", config=config)
    trackers.finish()
    (ours,) = (tmp_path / "ours" / "run").glob("*/hparams.yml")
    expected = {"lr": 3e-4, "epochs": 3, "model": "tiny", "seed": None, "scale": 2.0}
    assert yaml.safe_load(ours.read_text()) == expected
    accelerate = pytest.importorskip("accelerate.tracking")
    theirs = accelerate.TensorBoardTracker("run", str(tmp_path / "theirs"))
    theirs.start()
    theirs.store_init_configuration({k: v for k, v in expected.items() if v is not None})
    theirs.finish()
    (written,) = (tmp_path / "theirs" / "run").glob("*/hparams.yml")
    plain = {k: v for k, v in expected.items() if v is not None}
    assert written.read_text() == yaml.dump(plain) and yaml.safe_load(written.read_text()) == plain


def test_custom_tracker_receives_calls_and_log_kwargs():
    custom = ListTracker()
    trackers = TrackerSet([custom], None, is_main_process=True)
    trackers.init("run", config={"lr": 1})
    trackers.log({"loss": 2.0}, step=7, log_kwargs={"list": {"commit": True}})
    assert trackers.get("list") is custom and trackers.get("list", unwrap=True) is custom.calls
    trackers.finish()
    assert custom.calls == [
        ("start",),
        ("config", {"lr": 1}),
        ("log", {"loss": 2.0}, 7, {"commit": True}),
        ("finish",),
    ]


def test_other_processes_hold_only_trackers_that_ask_for_every_process(tmp_path):
    everywhere, main_only = ListTracker(main_process_only=False), ListTracker()
    main_only.name = "main_list"
    trackers = TrackerSet([everywhere, main_only, "jsonl"], tmp_path, is_main_process=False)
    trackers.init("run")
    trackers.log({"x": 1})
    assert trackers.trackers == [everywhere]
    assert main_only.calls == [] and not (tmp_path / "run").exists()


def test_blank_tracker_on_a_process_without_trackers(tmp_path):
    trackers = TrackerSet("jsonl", tmp_path, is_main_process=False)
    trackers.init("run")
    blank = trackers.get("jsonl")
    blank.log({"x": 1})  # a no-op, as in Accelerate
    assert blank.tracker is None
    with pytest.raises(ValueError, match="no tracker named 'wandb'"):
        trackers.get("wandb")


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_TRACKERS))
def test_unsupported_tracker_named_with_the_way_out(name):
    reason = UNSUPPORTED_TRACKERS[name].split(" (")[0]
    with pytest.raises(ValueError, match=rf"log_with='{name}' is not supported: it needs {reason}"):
        resolve_log_with(name)


@pytest.mark.parametrize("name", ["wandb", "mlflow", "comet_ml", "tensorboard"])
def test_tracker_without_its_package_is_refused_and_left_out_of_all(name, monkeypatch):
    package = TRACKERS[name][1]
    monkeypatch.setitem(sys.modules, package, None)  # what an uninstalled package looks like
    with pytest.raises(ValueError, match=rf"log_with='{name}' needs the {package} package"):
        resolve_log_with(name)
    assert name not in resolve_log_with("all") and "jsonl" in resolve_log_with("all")


def test_unknown_tracker_and_all(monkeypatch):
    with pytest.raises(ValueError, match="'tensorbord' is not a tracker"):
        resolve_log_with("tensorbord")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "COMET_START_ONLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    # wandb, MLflow and Comet join "all" only when told where to log (test_library_trackers.py).
    assert resolve_log_with(["all", "jsonl"]) == ["tensorboard", "jsonl"]


def test_file_trackers_need_a_directory():
    with pytest.raises(ValueError, match=r"\['tensorboard'\] writes files.*project_dir="):
        TrackerSet(["tensorboard"], None, is_main_process=True)


def test_values_that_cannot_be_recorded_are_refused(tmp_path):
    tracker = JSONLinesTracker("run", tmp_path)
    tracker.start()
    with pytest.raises(TypeError, match=r"cannot log 'preds': a tensor of shape \(3,\)"):
        tracker.log({"preds": torch.ones(3)})
    with pytest.raises(TypeError, match="cannot log 'items': a list"):
        tracker.log({"items": [1, 2]})
    tracker.finish()
    board = TensorBoardTracker("run", tmp_path)
    board.start()
    with pytest.raises(TypeError, match="cannot log 'group': a dict must hold numbers"):
        board.log({"group": {"a": "x"}})
    board.finish()


def test_subclass_missing_its_contract():
    class Incomplete(GeneralTracker):
        name = "incomplete"

    with pytest.raises(NotImplementedError, match="requires_logging_directory, tracker"):
        Incomplete()


@pytest.mark.distributed
def test_tracker_packages_are_imported_only_when_a_tracker_is_made():
    # A bare `pip install retarget` has none of them: importing retarget must not need them.
    probe = "import sys, retarget; print(sorted({'wandb', 'mlflow', 'comet_ml'} & {*sys.modules}))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
