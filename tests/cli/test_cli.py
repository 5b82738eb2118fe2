"""The `retarget` command line (cli/main.py, cli/demo.py) and its renderers (report/render.py,
report/dot_figure.py).

Commands run in-process through `main([...])` for speed; one test runs the installed console
script to prove the entry point and the current-directory import.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import fx

import retarget
from retarget.cli.demo import ProgressBar
from retarget.cli.main import main
from retarget.ir.program import PassRecord
from retarget.models import TinyConfig, synthetic_batch, tiny_lm
from retarget.report import render
from retarget.report.dot_figure import CHANGE_STYLES, is_check
from retarget.report.module_decisions import GLUE, REPEAT
from tests.paths import REPO

LLAMA = ["tests.zoo:tiny_llama", "--inputs", "tests.zoo:lm_inputs", "--target", "single"]
REGION = "model.layers.*"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` not installed")


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # `tests.zoo:...` specs resolve from the current directory, which the CLI puts on sys.path.
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def no_graphviz(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "dot" else real_which(name))


# ------------------------------------------------------------------------- inspect formats
def test_inspect_text_shows_report_decisions_and_graphs(capsys):
    code, out, _ = run(capsys, "inspect", *LLAMA)
    assert code == 0
    assert f"{REGION}  LlamaDecoderLayer  2        export" in out
    for name in ("find_blocks", "capture_regions", "annotate_shapes"):
        assert name in out
    assert "changed by: capture_regions" in out
    assert "--- final graph (after capture_regions)" in out
    assert "def forward(" in out and "torch.ops.aten.linear.default" in out
    decisions = out[out.index("module decisions") : out.index("region graphs")]
    assert "model.layers.0 " in decisions and "repeat 1/2 (export graph)" in decisions
    assert "inside model.layers.*" in decisions
    assert "model.embed_tokens" in decisions and "eager glue" in decisions
    # The second repeat runs the first one's graph: its submodules are folded into a count.
    assert "model.layers.1.mlp" not in decisions and "12 submodules as repeat 1" in decisions


def test_inspect_json_has_report_and_graphs(capsys, tmp_path):
    path = tmp_path / "nested" / "report.json"
    code, out, _ = run(capsys, "inspect", *LLAMA, "--format", "json", "--out", str(path))
    assert code == 0 and out.strip() == f"wrote {path}"
    data = json.loads(path.read_text())
    assert data["target"] == "single"
    assert [r["name"] for r in data["regions"]] == [REGION]
    assert data["regions"][0]["frontend"] == "export"
    assert [p["name"] for p in data["passes"]] == [
        "find_blocks",
        "capture_regions",
        "annotate_shapes",
    ]
    assert data["graphs"][REGION].startswith("def forward(")
    assert data["history_graphs"]["capture_regions"][REGION] == data["graphs"][REGION]
    assert data["history_graphs"]["find_blocks"] == {}
    roles = {row["path"]: row["role"] for row in data["module_tree"]}
    assert roles["model.layers.0"] == REPEAT and roles["lm_head"] == GLUE


def test_inspect_dot_has_tree_and_one_cluster_per_region(capsys):
    code, out, _ = run(capsys, "inspect", *LLAMA, "--format", "dot")
    assert code == 0
    assert out.startswith("digraph retarget {") and out.rstrip().endswith("}")
    assert "subgraph cluster_modules" in out
    assert out.count("subgraph cluster_region_") == 1
    assert '"mod:model.layers.0" [label="0\\nLlamaDecoderLayer' in out
    assert '"r0:linear" [label="linear\\n2x16x64"' in out  # op short name and meta shape
    assert '"r0:linear" -> "r0:view"' in out
    # Only the spine passes ran: no node is highlighted (the colors appear in the legend only).
    for fill, _, _ in CHANGE_STYLES.values():
        assert out.count(fill) == 1
    # Scaled to fit a screen; export's input checks are counted, not drawn.
    assert 'size="14,9", ratio=compress' in out
    assert "_guards_fn" not in out and "_assert_tensor_metadata" not in out
    assert "input checks not drawn" in out


def test_inspect_dot_shows_which_repeats_recompute(capsys):
    code, out, _ = run(capsys, "inspect", *LLAMA, "--target", "ac[every=2]", "--format", "dot")
    assert code == 0
    assert "ac: 1 of 2 repeats (full)" in out  # the region's title
    assert out.count("\\nac: full") == 1  # the checkpointed repeat in the module tree


@needs_dot
def test_inspect_svg(capsys):
    code, out, _ = run(capsys, "inspect", *LLAMA, "--format", "svg")
    assert code == 0
    assert out.startswith("<?xml") and "<svg" in out and "LlamaDecoderLayer" in out


def test_svg_without_graphviz_exits_2_before_building_the_model(capsys, monkeypatch):
    no_graphviz(monkeypatch)
    code, out, err = run(
        capsys, "inspect", "tests.zoo:nothing", "--target", "single", "--format", "svg"
    )
    assert code == 2 and out == ""
    # The factory spec is wrong too: the graphviz check comes first, before any import.
    assert "apt-get install graphviz" in err and "--format dot" in err


@needs_dot
def test_html_inlines_svg_and_escapes_text(capsys):
    code, out, _ = run(capsys, "inspect", *LLAMA, "--format", "html")
    assert code == 0
    assert out.startswith("<!DOCTYPE html>") and "<svg" in out and "<?xml" not in out
    # The report's "frontends={'export': 1}" is escaped, as is the graph code.
    assert "{&#x27;export&#x27;: 1}" in out and "{'export': 1}" not in out
    assert "<h4>final graph (after capture_regions)</h4>" in out


def test_html_without_graphviz_falls_back_to_escaped_dot(capsys, monkeypatch):
    no_graphviz(monkeypatch)
    code, out, _ = run(capsys, "inspect", *LLAMA, "--format", "html")
    assert code == 0 and "<svg" not in out
    assert "apt-get install graphviz" in out
    assert "digraph retarget {" in out and "&quot;r0:linear&quot; -&gt; &quot;r0:view&quot;" in out
    assert '"r0:linear" -> ' not in out


def test_inspect_without_inputs_reports_lazy_capture(capsys):
    code, out, _ = run(capsys, "inspect", "retarget.models:tiny_lm", "--target", "single")
    assert code == 0
    assert "lazy" in out and "no graph (captured at first call)" in out


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("foo", "is malformed"),
        ("nomodule:x", "no module named 'nomodule'"),
        ("tests.zoo:nothing", "has no attribute 'nothing'"),
        ("tests.zoo:tiny_lama", "did you mean 'tiny_llama'?"),
    ],
)
def test_bad_factory_spec_exits_2_with_one_line(capsys, spec, problem):
    code, out, err = run(capsys, "inspect", spec, "--target", "single")
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert spec in err and problem in err and "package.module:function" in err


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("fsdpp", "did you mean 'fsdp'?"),
        ("tp[size=2,sequence_parallel=true,plan=hf]", "use plan=auto"),
    ],
)
def test_bad_target_exits_2(capsys, target, problem):
    code, _, err = run(capsys, "inspect", *LLAMA[:3], "--target", target)
    assert code == 2
    assert err.startswith("retarget inspect: error:") and problem in err


def test_usage_errors_and_version_return_codes(capsys):
    assert main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err
    assert main(["inspect", "tests.zoo:tiny_llama", "--target", "single", "--format", "png"]) == 2
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"retarget {retarget.__version__}")


@pytest.mark.distributed
def test_console_script_imports_from_the_current_directory(tmp_path):
    """The installed `retarget` script finds a factory module that lives in the cwd only."""
    script = shutil.which("retarget")
    assert script is not None, "console script not installed: pip install -e ."
    (tmp_path / "toy_models.py").write_text(
        textwrap.dedent(
            """
            import torch
            from retarget.models import tiny_lm

            def model():
                torch.manual_seed(0)
                return tiny_lm(layers=2, hidden=32, heads=2)
            """
        )
    )
    # No --inputs: capture is lazy, which keeps this fresh process clear of torch.export's
    # start-up cost (the in-process tests cover capture).
    argv = [script, "inspect", "toy_models:model", "--target", "single", "--format", "json"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["model"] == "TinyLM" and data["lazy"] is True
    assert [(r["name"], r["frontend"]) for r in data["regions"]] == [("layers.*", "pending")]


# ------------------------------------------------------------------------- demo
def test_demo_trains_and_prints_report_and_loss(capsys):
    code, out, err = run(capsys, "demo", "--steps", "3", "--batch", "2", "--seq", "8")
    assert code == 0
    assert "retarget report: TinyLM" in out and "layers.*" in out
    assert "loss: first " in out and "over 3 steps" in out
    # stderr is not a terminal under pytest: plain progress lines, no carriage returns.
    assert "step 3/3  loss " in err and "\r" not in err
    # It says first what it trains; the report shows the activations it measured after training.
    assert err.startswith("retarget demo: a TinyLM (2 blocks, ")
    assert "for 'single', trained 3 steps with AdamW on 4 synthetic batches of 2 x 8" in err
    assert "activations not measured" not in out and "activations unknown" not in out


@pytest.mark.distributed
def test_demo_under_launch_speaks_from_one_rank(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-m", "retarget", "launch", "-q", "--num_processes", "2", "-m"]
        + ["retarget", "demo", "--steps", "2", "--batch", "2", "--seq", "8", "--target", "ddp"],
        cwd=tmp_path, env={**env, "HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("retarget report: TinyLM") == 1
    assert done.stderr.count("retarget demo: a TinyLM") == 1


def test_demo_rejects_sequence_longer_than_rotary_tables(capsys):
    code, _, err = run(capsys, "demo", "--seq", str(TinyConfig().max_seq + 1))
    assert code == 2 and "--seq must be between 2" in err


def test_progress_bar_redraws_one_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    bar = ProgressBar(4, stream, width=8)
    for step in range(1, 5):
        bar.update(step, 1.0 / step)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert "[########] step 4/4  loss 0.2500" in text


# ------------------------------------------------------------------------- highlighting
@pytest.fixture(scope="module")
def rewritten_program():
    """TinyLM compiled, then a fake pass that inserts a clone after the first op of the block.

    Module-scoped to compile once: the tests using it only render, never change it.
    """
    torch.manual_seed(0)
    config = TinyConfig(layers=2, hidden=32, heads=2)
    example = synthetic_batch(config, batch=2, seq=8, generator=torch.Generator().manual_seed(0))
    program = retarget.compile_for(
        tiny_lm(layers=2, hidden=32, heads=2), example_inputs=example
    ).program
    region = program.regions[0]
    graph = region.representative().gm.graph
    first = next(n for n in graph.nodes if n.op == "call_function" and n.users)
    added: list[str] = []

    def insert_clone(gm: fx.GraphModule) -> None:
        node = next(n for n in gm.graph.nodes if n.name == first.name)
        with gm.graph.inserting_after(node):
            clone = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
        node.replace_all_uses_with(clone, delete_user_cb=lambda user: user is not clone)
        added.append(clone.name)

    region.add_transform("fake_clone", insert_clone)
    record = PassRecord("fake_clone", "", "exact", 0.0, True, {}, (), program.graph_text())
    program.history.append(record)
    return program, first.name, added[0]


def test_dot_highlights_nodes_added_after_capture(rewritten_program):
    program, first, clone = rewritten_program
    lines = render.render_dot(program).splitlines()
    added_fill = CHANGE_STYLES["added"][0]
    drawn = next(line for line in lines if line.strip().startswith(f'"r0:{clone}" ['))
    assert added_fill in drawn and "+ fake_clone" in drawn
    untouched = next(line for line in lines if line.strip().startswith(f'"r0:{first}" ['))
    assert "fake_clone" not in untouched and added_fill not in untouched
    assert f'"r0:{first}" -> "r0:{clone}"' in "\n".join(lines)


def test_text_shows_diff_of_later_pass(rewritten_program):
    program, first, clone = rewritten_program
    text = render.render_text(program)
    assert "changed by: capture_regions, fake_clone" in text
    assert "--- diff by fake_clone" in text
    assert f"+    {clone} = torch.ops.aten.clone.default({first})" in text
    assert "--- final graph (after fake_clone)" in text


def test_dot_caps_large_graphs(rewritten_program):
    program, _, _ = rewritten_program
    nodes = program.regions[0].representative().gm.graph.nodes
    total = sum(not is_check(n) for n in nodes)  # export's input checks are not drawn
    dot = render.render_dot(program, max_nodes=5)
    assert f'"r0:..." [label="... {total - 5} more"' in dot
    defined = [line for line in dot.splitlines() if line.strip().startswith('"r0:') and "[" in line]
    assert len(defined) == 5 + 1  # five drawn nodes and the fold


def test_every_option_with_a_default_shows_it_in_help():
    import argparse

    from retarget.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, sub in commands.choices.items():
        text = sub.format_help()
        for action in sub._actions:
            if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
                continue
            if f"default: {action.default}" not in text and "default" not in (action.help or ""):
                missing.append(f"{name} {action.option_strings[0]}")
    assert missing == []


def test_an_unknown_flag_gets_the_commands_usage(capsys):
    assert main(["launch", "--no-such-flag", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: retarget launch") and "unrecognized arguments: --no-such" in err
