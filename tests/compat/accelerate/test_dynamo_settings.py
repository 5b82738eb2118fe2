"""Accelerate's torch.compile knobs as the compile part: Accelerator(dynamo_backend=,
dynamo_plugin=), ACCELERATE_DYNAMO_*, `retarget launch --dynamo_*`; one Accelerator trains a tiny
Llama under dynamo_backend="aot_eager" like the uncompiled one."""

from __future__ import annotations

import accelerate.utils
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import retarget
from retarget.cli.main import build_parser
from retarget.compat.accelerate.dynamo import ENV_PREFIX, TorchDynamoPlugin, dynamo_target
from retarget.compat.accelerate.kwargs_base import KwargsHandlerError
from retarget.core.world import TARGET_ENV
from retarget.launch.command_line import plan_from_args
from retarget.launch.config import CONFIG_ENV, LaunchError
from retarget.targets.dynamo_settings import DynamoSettings, with_compile
from retarget.targets.grammar import Target
from tests import zoo

VARIABLES = ("BACKEND", "MODE", "USE_FULLGRAPH", "USE_DYNAMIC", "USE_REGIONAL_COMPILATION")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    """No ACCELERATE_DYNAMO_*, retarget config or launched target from the shell."""
    for name in VARIABLES:
        monkeypatch.delenv(ENV_PREFIX + name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv(TARGET_ENV, raising=False)


def target(spec: str = "ddp", **arguments) -> str:
    return str(dynamo_target(Target.parse(spec), **arguments))


# ------------------------------------------------------------------------------ the table
def test_each_setting_maps_to_its_compile_option():
    def options(**fields):
        return DynamoSettings(backend="INDUCTOR", **fields).compile_options()

    assert options() == {"backend": "inductor", "fullgraph": False}
    assert options(mode="max-autotune")["mode"] == "max-autotune"
    assert "mode" not in options(mode="default")
    assert options(fullgraph=True)["fullgraph"] is True
    assert options(dynamic=True)["dynamic"] is True and options(dynamic=False)["dynamic"] is False
    assert "dynamic" not in options()  # None: dynamic=auto
    # Both values compile regions; True says so explicitly.
    assert options(use_regional_compilation=True)["scope"] == "regions"
    assert "scope" not in options(use_regional_compilation=False)
    assert DynamoSettings(backend="no").compile_options() is None
    assert DynamoSettings(backend="NO").compile_options() is None
    replaced = with_compile(Target.parse("ddp+compile[mode=max-autotune]"), {"backend": "eager"})
    assert str(replaced) == "ddp+compile[backend=eager]"
    assert str(with_compile(Target.parse("fsdp+bf16+compile"), None)) == "fsdp+bf16"


# ------------------------------------------------------------------------------ Accelerator
@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("inductor", "ddp+compile"),
        ("aot_eager", "ddp+compile[backend=aot_eager]"),
        ("AOT_EAGER", "ddp+compile[backend=aot_eager]"),
        (accelerate.utils.DynamoBackend.EAGER, "ddp+compile[backend=eager]"),
        ("no", "ddp"),
        ("NO", "ddp"),
    ],
)
def test_dynamo_backend_is_the_compile_backend(backend, expected):
    assert target(dynamo_backend=backend) == expected


def test_a_dynamo_argument_replaces_a_launched_compile_part_and_must_agree_with_target(
    monkeypatch,
):
    assert target("ddp+compile[mode=max-autotune]", dynamo_backend="eager") == (
        "ddp+compile[backend=eager]"
    )
    assert target("ddp+compile", dynamo_backend="no") == "ddp"
    assert target("ddp+compile", dynamo_backend="inductor", origin="target=") == "ddp+compile"
    with pytest.raises(retarget.TargetError, match=r"says compile but dynamo_backend='no'.*keep"):
        target("ddp+compile", dynamo_backend="no", origin="target=")
    with pytest.raises(retarget.TargetError, match=r"dynamo_plugin asks for compile\[backend="):
        plugin = TorchDynamoPlugin(backend="eager")
        target("ddp+compile", dynamo_plugin=plugin, origin="target=")
    # Through the Accelerator: a launched target's compile part, and an explicit one.
    monkeypatch.setenv(TARGET_ENV, "single+compile[backend=eager]")
    assert str(retarget.Accelerator(dynamo_backend="no").target) == "single"
    assert str(retarget.Accelerator().target) == "single+compile[backend=eager]"
    monkeypatch.delenv(TARGET_ENV)
    with pytest.raises(retarget.TargetError, match="keep one"):
        retarget.Accelerator(target="compile[backend=eager]", dynamo_backend="aot_eager")


def test_the_plugin_maps_every_field():
    plugin = TorchDynamoPlugin(
        backend="inductor",
        mode="max-autotune",
        fullgraph=True,
        dynamic=False,
        use_regional_compilation=True,
    )
    assert target(dynamo_plugin=plugin) == (
        "ddp+compile[dynamic=false,fullgraph=true,mode=max-autotune]"
    )
    assert target(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", dynamic=True)) == (
        "ddp+compile[backend=aot_eager,dynamic=true]"
    )
    assert target(dynamo_plugin=TorchDynamoPlugin(backend="inductor", disable=True)) == "ddp"
    assert target(dynamo_plugin=TorchDynamoPlugin()) == "ddp"  # backend no


def test_accelerates_own_plugin_is_read_like_ours():
    theirs = accelerate.utils.TorchDynamoPlugin(
        backend="aot_eager", fullgraph=True, dynamic=True, use_regional_compilation=True
    )
    ours = TorchDynamoPlugin(
        backend="aot_eager", fullgraph=True, dynamic=True, use_regional_compilation=True
    )
    assert (
        target(dynamo_plugin=theirs)
        == target(dynamo_plugin=ours)
        == ("ddp+compile[backend=aot_eager,dynamic=true,fullgraph=true]")
    )


def test_plugin_refusals_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="dynamo_backend= or dynamo_plugin=, not both"):
        target(dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    with pytest.raises(KwargsHandlerError, match=r"options=.*drop options"):
        target(dynamo_plugin=TorchDynamoPlugin(backend="inductor", options={"trace.enabled": 1}))
    with pytest.raises(TypeError, match="not a TorchDynamoPlugin"):
        target(dynamo_plugin={"backend": "inductor"})


ENVIRONMENTS = [
    {},
    {"BACKEND": "AOT_EAGER"},
    {"BACKEND": "INDUCTOR", "MODE": "max-autotune", "USE_FULLGRAPH": "True"},
    {"BACKEND": "EAGER", "USE_DYNAMIC": "False", "USE_REGIONAL_COMPILATION": "true"},
    {"BACKEND": "NO", "USE_DYNAMIC": "1"},
]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_the_plugin_reads_the_environment_as_accelerates_does(monkeypatch, environment):
    for name, value in environment.items():
        monkeypatch.setenv(ENV_PREFIX + name, value)
    ours, theirs = TorchDynamoPlugin(), accelerate.utils.TorchDynamoPlugin()
    for field in ("mode", "fullgraph", "dynamic", "use_regional_compilation"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.backend == theirs.backend.value.lower()
    # A field given wins over its variable, in both.
    given = {"mode": "reduce-overhead", "fullgraph": False}
    ours, theirs = TorchDynamoPlugin(**given), accelerate.utils.TorchDynamoPlugin(**given)
    assert (ours.mode, ours.fullgraph) == (theirs.mode, theirs.fullgraph)


def test_the_environment_alone_adds_a_compile_part_only_where_the_target_has_none(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "BACKEND", "AOT_EAGER")
    monkeypatch.setenv(ENV_PREFIX + "USE_DYNAMIC", "False")
    assert target() == "ddp+compile[backend=aot_eager,dynamic=false]"
    assert target("ddp+compile[backend=eager]") == "ddp+compile[backend=eager]"
    # dynamo_backend= takes the other fields from the environment, as Accelerate's does.
    assert target(dynamo_backend="eager") == "ddp+compile[backend=eager,dynamic=false]"
    monkeypatch.setenv(ENV_PREFIX + "USE_FULLGRAPH", "maybe")
    with pytest.raises(retarget.ConfigError, match="ACCELERATE_DYNAMO_USE_FULLGRAPH='maybe'"):
        target()


def test_the_accelerator_takes_both_arguments():
    assert str(retarget.Accelerator(dynamo_backend="aot_eager").target) == (
        "single+compile[backend=aot_eager]"
    )
    plugin = retarget.TorchDynamoPlugin(backend="eager", fullgraph=True)
    assert str(retarget.Accelerator(dynamo_plugin=plugin).target) == (
        "single+compile[backend=eager,fullgraph=true]"
    )


# ------------------------------------------------------------------------------ launch flags
def launched(tmp_path, *argv: str, config: str | None = None) -> str:
    script = tmp_path / "train.py"
    script.write_text("")
    extra = []
    if config is not None:
        path = tmp_path / "config.yaml"
        path.write_text(config)
        extra = ["--config_file", str(path)]
    args = build_parser().parse_args(["launch", *extra, *argv, str(script)])
    return str(plan_from_args(args).target)


def test_launch_flags_become_the_compile_part(tmp_path):
    two = ("--num_processes", "2")
    assert launched(tmp_path, *two) == "ddp"
    # accelerate launch exports ACCELERATE_DYNAMO_USE_DYNAMIC=False when the flag is absent.
    assert launched(tmp_path, *two, "--dynamo_backend", "inductor") == (
        "ddp+compile[dynamic=false]"
    )
    assert launched(tmp_path, *two, "--dynamo_backend", "no") == "ddp"
    every = (
        "--dynamo-backend",
        "aot_eager",
        "--dynamo_mode",
        "default",
        "--dynamo_use_fullgraph",
        "--dynamo_use_dynamic",
        "--dynamo_use_regional_compilation",
    )
    assert launched(tmp_path, "--target", "fsdp+bf16", *every) == (
        "fsdp+bf16+compile[backend=aot_eager,dynamic=true,fullgraph=true]"
    )
    assert launched(tmp_path, "--dynamo_backend", "inductor", "--dynamo_mode", "max-autotune") == (
        "single+compile[dynamic=false,mode=max-autotune]"
    )


def test_launch_flags_change_the_compile_part_of_the_target_in_effect(tmp_path):
    config = "distributed_type: NO\ndynamo_config:\n  dynamo_backend: INDUCTOR\n"
    assert launched(tmp_path, config=config) == "single+compile[dynamic=false]"
    assert launched(tmp_path, "--dynamo_use_fullgraph", config=config) == (
        "single+compile[dynamic=false,fullgraph=true]"
    )
    assert launched(tmp_path, "--dynamo_backend", "no", config=config) == "single"
    spec = "ddp+compile[backend=eager,mode=default]"
    assert launched(tmp_path, "--target", spec, "--dynamo_backend", "aot_eager") == (
        "ddp+compile[backend=aot_eager]"
    )


def test_launch_flags_without_a_backend_or_beside_no_are_refused(tmp_path):
    with pytest.raises(LaunchError, match=r"--dynamo_mode changes torch.compile.*--dynamo_backend"):
        launched(tmp_path, "--dynamo_mode", "max-autotune")
    with pytest.raises(LaunchError, match="--dynamo_use_fullgraph given with --dynamo_backend no"):
        launched(tmp_path, "--dynamo_backend", "no", "--dynamo_use_fullgraph")
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------------------------ end to end
class TokenRows(Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.rows = torch.randint(0, zoo.VOCAB, (6, zoo.SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _train_three_steps(dynamo_backend: str):
    accelerator = retarget.Accelerator(dynamo_backend=dynamo_backend)
    model = zoo.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TokenRows(), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_an_accelerator_with_aot_eager_trains_like_the_uncompiled_one():
    plain, plain_losses = _train_three_steps("no")
    compiled, losses = _train_three_steps("aot_eager")
    assert len(losses) == 3
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses, strict=True)) <= 1e-5
    weights, reference = compiled.state_dict(), plain.state_dict()
    assert list(weights) == list(reference)
    assert max((weights[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5
    report = str(compiled.report)
    table = report.split("compile (torch.compile; glue outside regions runs eagerly)\n")[1]
    row = table.splitlines()[1]
    assert row.split()[1:5] == ["aot_eager", "default", "graph", "1"] and "compiled" in row
    assert "compile (torch.compile" not in str(plain.report)
