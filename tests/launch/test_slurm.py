"""launch/slurm.py: launch settings from a SLURM allocation, and how they layer with flags."""

from __future__ import annotations

import pytest

from retarget.launch.config import LaunchConfig, LaunchError
from retarget.launch.launcher import describe, resolve
from retarget.launch.slurm import expand_nodelist, slurm_settings


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("gpu[08-10,12],cpu5", ["gpu08", "gpu09", "gpu10", "gpu12", "cpu5"]),
        ("a[1,3]-ib,b[7-8]", ["a1-ib", "a3-ib", "b7", "b8"]),
    ],
)
def test_nodelists_expand_like_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-", "node[a-b]", "x[1-2]]"])
def test_a_nodelist_that_cannot_be_read_is_named(bad):
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(bad)


ALLOCATION = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_GPUS_ON_NODE": "4",
}


def test_an_allocation_gives_machines_rank_address_and_processes():
    config, said = slurm_settings(ALLOCATION)
    assert (config.num_machines, config.machine_rank) == (2, 1)
    assert config.main_process_ip == "gpu07" and config.num_processes == 8
    assert "job 4242" in said and "machine_rank=1 (SLURM_NODEID)" in said
    assert config.origin("main_process_ip") == "SLURM_JOB_NODELIST"


def test_outside_slurm_nothing_is_derived():
    assert slurm_settings({"HOME": "/root"}) is None


def test_without_a_gpu_count_the_processes_are_not_guessed():
    environ = {k: v for k, v in ALLOCATION.items() if k != "SLURM_GPUS_ON_NODE"}
    config, _ = slurm_settings(environ)
    assert config.num_processes is None


def test_flags_win_over_slurm_and_the_launch_line_says_what_was_derived(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for key, value in ALLOCATION.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HOME", str(tmp_path))
    plan = resolve(str(script), flags=LaunchConfig(num_processes=2))
    assert plan.num_processes == 2 and plan.num_machines == 2 and plan.machine_rank == 1
    assert plan.main_process_ip == "gpu07"
    assert "from SLURM job 4242" in describe(plan)
    # The target is the launched one, which a script that names its own does not use.
    assert "launched target ddp (default for 2 processes; what compile_for and the " in (
        describe(plan)
    )
