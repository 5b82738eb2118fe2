"""bench/gpu/run.sh, the prepared GPU check, run as the GPU machine will run it but on CPU
(`--dry-run`): in a fresh virtual environment where retarget comes only from PYTHONPATH and the
carried wheel folder is installed with --no-index, so the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.paths import REPO


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel `name` (one module saying its version), as a carried wheel."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f'VERSION = "{version}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


@pytest.mark.distributed  # a fresh venv and the script's own processes,
@pytest.mark.one_process  # one at a time
def test_dry_run_in_a_fresh_venv_with_carried_wheels(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # The packages the GPU machine has preinstalled (torch, transformers, pytest, ...): this
    # machine's, seen through a .pth file; retarget itself is not among them (an editable
    # install's finder is a .pth of its own, which is not read from a folder a .pth adds).
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "machine_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = subprocess.run([python, "-c", "import retarget"], capture_output=True, cwd=tmp_path)
    assert probe.returncode != 0, "retarget must come from run.sh's PYTHONPATH, not the venv"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "carried_probe", "1.2.3")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RETARGET_TEST_DEVICE")}
    env.update(
        PYTHON=str(python),
        RETARGET_GPU_WHEELS=str(wheels),
        RETARGET_GPU_SITE=str(tmp_path / "site"),
        PIP_NO_INDEX="1",
    )
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu" / "run.sh"), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(--no-index): carried_probe-1.2.3" in done.stdout
    assert (tmp_path / "site" / "carried_probe" / "__init__.py").is_file()
    environment = json.loads((out / "environment.json").read_text())
    assert environment["device"].startswith("cpu") and environment["torch"]
    assert not environment["retarget"].startswith("import failed")
    assert " passed" in (out / "tests.log").read_text()
    report = json.loads((out / "gpu_bench.json").read_text())
    assert report["dry_run"] and len(report["arms"]) == 9
    for name, arm in report["arms"].items():
        assert "error" not in arm, (name, arm)
        assert arm["tokens_per_s"] > 0 and arm["device"] == environment["device"]
    assert all(isinstance(v, float) for v in report["ratios"].values())
    table = (out / "gpu_bench.md").read_text()
    assert "| retarget fp8 torchao+compile |" in table and "dry run (CPU, tiny model)" in table
    loading = json.loads((out / "quant_load.json").read_text())
    assert loading["dry_run"] and loading["arms"]["ours"]["peak_added_bytes"] > 0
    accelerate = loading["arms"]["accelerate"]  # it needs a GPU: refused here, with its reason
    assert "GPU" in accelerate.get("refused", "") or "bitsandbytes" in accelerate.get("refused", "")
