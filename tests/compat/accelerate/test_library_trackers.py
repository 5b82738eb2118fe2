"""wandb (offline), MLflow (local file store) and Comet (offline) runs hold what was logged, read
back with the libraries' own formats and clients; log_with="all" feeds every installed tracker."""

from __future__ import annotations

import importlib.util
import json
import struct
import zipfile

import pytest
import torch

from retarget.compat.accelerate.tracker_set import TrackerSet, resolve_log_with


def wandb_records(run_dir):
    """The protobuf Records of the run's `.wandb` file: a LevelDB-style log of 32 KiB blocks,
    each record split into chunks with a (crc, length, kind) header; wandb's Python package no
    longer ships a reader, so this walks the blocks and parses with wandb's own Record type."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_run_dir(wandb_dir, run_id):
    """The folder of offline run `run_id`, once wandb's service has written it out: Run.finish
    returns before the service flushes the .wandb file, and teardown waits for it."""
    import wandb

    wandb.teardown()
    (run_dir,) = (wandb_dir / "wandb").glob(f"offline-run-*-{run_id}")
    return run_dir


def wandb_history_and_config(run_dir):
    """([{key: value} per logged step], {config key: value}) of one offline run."""
    history, config = [], {}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append(
                {k: v for k, v in row.items() if not k.startswith("_")} | {"_step": row["_step"]}
            )
        elif kind == "config":
            config |= {u.key: json.loads(u.value_json) for u in record.config.update}
    return history, {k: v for k, v in config.items() if not k.startswith("_")}


def go_offline(wandb, folder, monkeypatch):
    """Runs without a server, under `folder`; wandb's settings are read once per process, so
    the caller tears them down after the test."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(folder))
    wandb.teardown()


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    wandb = pytest.importorskip(
        "wandb", reason="wandb is not installed: pip install 'retarget[trackers]'"
    )
    go_offline(wandb, tmp_path, monkeypatch)
    yield tmp_path
    wandb.teardown()


def comet_messages(folder):
    """{message type: [payload]} of the one offline experiment zipped under `folder`."""
    (path,) = folder.glob("*.zip")
    messages: dict[str, list] = {}
    with zipfile.ZipFile(path) as archive:
        for line in archive.read("messages.json").decode().splitlines():
            message = json.loads(line)
            messages.setdefault(message["type"], []).append(message["payload"])
    return messages


def comet_offline(folder, monkeypatch):
    monkeypatch.setenv("COMET_START_ONLINE", "false")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(folder))
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")


@pytest.fixture
def file_mlflow(tmp_path, monkeypatch):
    pytest.importorskip(
        "mlflow", reason="mlflow is not installed: pip install 'retarget[trackers]'"
    )
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks before a file store
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_wandb_offline_run_holds_logged_values_and_config(offline_wandb):
    trackers = TrackerSet("wandb", None, is_main_process=True)
    trackers.init(
        "proj", config={"lr": 0.1, "epochs": 2}, init_kwargs={"wandb": {"dir": str(offline_wandb)}}
    )
    trackers.log({"loss": torch.tensor(1.5), "acc": 0.0}, step=0)
    trackers.log({"loss": 1.0, "acc": 0.25, "phase": "eval", "group": {"a": 2.0}}, step=1)
    run = trackers.get("wandb", unwrap=True)
    assert run.settings.mode == "offline" and run.project == "proj"
    trackers.finish()
    run_dir = offline_run_dir(offline_wandb, run.id)
    history, config = wandb_history_and_config(run_dir)
    assert config == {"lr": 0.1, "epochs": 2}
    assert history == [
        {"loss": 1.5, "acc": 0, "_step": 0},
        {"loss": 1, "acc": 0.25, "phase": "eval", "group/a": 2, "_step": 1},
    ]


def test_wandb_table_and_values_it_cannot_record(offline_wandb):
    trackers = TrackerSet("wandb", None, is_main_process=True)
    trackers.init("proj")
    tracker = trackers.get("wandb")
    with pytest.raises(TypeError, match=r"cannot log 'preds': a tensor of shape \(3,\)"):
        tracker.log({"preds": torch.ones(3)}, step=0)
    tracker.log_table("samples", columns=["x", "y"], data=[[1, "a"], [2, "b"]], step=0)
    run_id = tracker.tracker.id
    trackers.finish()
    run_dir = offline_run_dir(offline_wandb, run_id)
    history, _ = wandb_history_and_config(run_dir)
    assert len(history) == 1 and history[0]["samples/_type"] == "table-file"
    table_file = run_dir / "files" / history[0]["samples/path"]
    assert json.loads(table_file.read_text())["data"] == [[1, "a"], [2, "b"]]


def test_mlflow_file_store_holds_metrics_and_params(file_mlflow, tmp_path):
    from mlflow import MlflowClient

    trackers = TrackerSet("mlflow", None, is_main_process=True)
    trackers.init(
        "proj",
        config={"lr": 0.1, "epochs": 2},
        init_kwargs={
            "mlflow": {"run_name": "first", "tags": {"team": "a"}, "logging_dir": tmp_path / "art"}
        },
    )
    for step, loss in enumerate([1.5, 1.0]):
        trackers.log({"loss": torch.tensor(loss), "group": {"a": step}}, step=step)
    run_id = trackers.get("mlflow", unwrap=True).info.run_id
    with pytest.raises(TypeError, match="cannot log 'phase' to MLflow: a str"):
        trackers.log({"phase": "eval"})
    trackers.finish()
    client = MlflowClient(tracking_uri=file_mlflow)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "proj" and experiment.artifact_location.endswith("/art")
    assert run.data.params == {"lr": "0.1", "epochs": "2"} and run.data.tags["team"] == "a"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [
        (0, 1.5),
        (1, 1.0),
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "group/a")] == [
        (0, 0.0),
        (1, 1.0),
    ]


def test_mlflow_refuses_params_it_would_cut(file_mlflow):
    from mlflow import MlflowClient

    trackers = TrackerSet("mlflow", None, is_main_process=True)
    trackers.init("proj")
    with pytest.raises(ValueError, match=r"cannot store \['notes'\] as MLflow parameters"):
        trackers.get("mlflow").store_init_configuration({"notes": "x" * 100_000, "lr": 1})
    run_id = trackers.get("mlflow", unwrap=True).info.run_id
    trackers.finish()
    assert MlflowClient(tracking_uri=file_mlflow).get_run(run_id).data.params == {}


def test_only_the_main_process_logs_to_library_trackers(offline_wandb, file_mlflow, tmp_path):
    trackers = TrackerSet(["wandb", "mlflow"], None, is_main_process=False)
    trackers.init("proj", config={"lr": 1})
    trackers.log({"loss": 1.0})
    trackers.finish()
    assert trackers.get("wandb").tracker is None and list(tmp_path.iterdir()) == []


def test_all_feeds_every_installed_tracker_told_where_to_log(tmp_path, monkeypatch, request):
    installed = {n for n in ("wandb", "mlflow", "comet_ml") if importlib.util.find_spec(n)}
    if "comet_ml" in installed:
        comet_offline(tmp_path / "comet", monkeypatch)
    if "wandb" in installed:
        import wandb

        go_offline(wandb, tmp_path, monkeypatch)
        request.addfinalizer(wandb.teardown)
    if "mlflow" in installed:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    names = resolve_log_with("all")
    assert set(names) == {"tensorboard", "jsonl"} | installed
    trackers = TrackerSet("all", tmp_path, is_main_process=True)
    trackers.init("proj", config={"lr": 0.1})
    trackers.log({"loss": 0.5}, step=1)
    assert [t.name for t in trackers] == names
    handles = {t.name: t.tracker for t in trackers}
    trackers.finish()
    assert json.loads((tmp_path / "proj" / "log.jsonl").read_text())["values"] == {"loss": 0.5}
    if "tensorboard" in names:
        assert list((tmp_path / "proj").glob("events.out.tfevents.*"))
    if "wandb" in names:
        run_dir = offline_run_dir(tmp_path, handles["wandb"].id)
        assert wandb_history_and_config(run_dir)[0] == [{"loss": 0.5, "_step": 1}]
    if "mlflow" in names:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
        run = client.get_run(handles["mlflow"].info.run_id)
        assert run.data.metrics == {"loss": 0.5} and run.data.params == {"lr": "0.1"}
    if "comet_ml" in names:
        metrics = comet_messages(tmp_path / "comet")["metric_msg"]
        named = [(m["metric"]["metricName"], m["metric"]["metricValue"]) for m in metrics]
        assert [m for m in named if not m[0].startswith("sys.")] == [("loss", 0.5)]


def test_accelerator_logs_to_wandb_and_mlflow(offline_wandb, file_mlflow):
    from mlflow import MlflowClient

    from retarget import Accelerator

    accelerator = Accelerator(log_with=["wandb", "mlflow"])
    accelerator.init_trackers("proj", config={"lr": 0.5})
    accelerator.log({"loss": torch.tensor(1.25)}, step=2)
    run = accelerator.get_tracker("wandb", unwrap=True)
    mlflow_run_id = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    accelerator.end_training()
    run_dir = offline_run_dir(offline_wandb, run.id)
    assert wandb_history_and_config(run_dir) == ([{"loss": 1.25, "_step": 2}], {"lr": 0.5})
    logged = MlflowClient(tracking_uri=file_mlflow).get_run(mlflow_run_id).data
    assert (logged.metrics, logged.params) == ({"loss": 1.25}, {"lr": "0.5"})


def test_comet_offline_experiment_holds_metrics_params_and_others(tmp_path, monkeypatch):
    pytest.importorskip("comet_ml", reason="comet_ml is not installed: pip install comet_ml")
    comet_offline(tmp_path, monkeypatch)
    trackers = TrackerSet("comet_ml", None, is_main_process=True)
    trackers.init("proj", config={"lr": 0.1, "epochs": 2})
    trackers.log({"loss": torch.tensor(1.5), "group": {"a": 2}}, step=0)
    trackers.log({"loss": 1.0, "phase": "eval"}, step=1)
    assert type(trackers.get("comet_ml", unwrap=True)).__name__ == "OfflineExperiment"
    trackers.finish()
    messages = comet_messages(tmp_path)
    params = {p["param"]["paramName"]: p["param"]["paramValue"] for p in messages["parameter_msg"]}
    assert params["lr"] == 0.1 and params["epochs"] == 2
    metrics = [
        (m["metric"]["metricName"], m["metric"]["step"], m["metric"]["metricValue"])
        for m in messages["metric_msg"]
        if not m["metric"]["metricName"].startswith("sys.")
    ]
    assert metrics == [("loss", 0, 1.5), ("group/a", 0, 2), ("loss", 1, 1.0)]
    assert {"key": "phase", "value": "eval"} in [
        {k: o[k] for k in ("key", "value")} for o in messages["log_other"]
    ]


def test_wandb_log_images(offline_wandb):
    np = pytest.importorskip("numpy")
    trackers = TrackerSet("wandb", None, is_main_process=True)
    trackers.init("proj")
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    trackers.get("wandb").log_images({"samples": [image, image + 255]}, step=3)
    run_id = trackers.get("wandb", unwrap=True).id
    trackers.finish()
    run_dir = offline_run_dir(offline_wandb, run_id)
    (row,) = wandb_history_and_config(run_dir)[0]
    assert row["samples/_type"] == "images/separated" and row["samples/count"] == 2
    assert row["_step"] == 3 and len(list(run_dir.glob("files/media/images/samples_*.png"))) == 2
