"""The FSDP config file `accelerate config` (1.15) writes when every question takes its default
after "multi-GPU" and "yes" to FSDP: FSDP2 with fsdp_cpu_ram_efficient_loading: true. It launches
as is, and training starts from the checkpoint's weights with the non-main ranks' models built
on the meta device (loading on rank 0 only, the memory saving the option is turned on for).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.paths import REPO, SCRIPTS

#: As written by `accelerate config` with defaults (the wrapped layer class typed in), except
#: num_processes: 2 (its default is the number of GPUs).
STOCK_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


@pytest.mark.distributed
def test_the_stock_fsdp_config_launches_and_loads_on_rank_0_only(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(  # the default config, sizes shrunk
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    (tmp_path / "fsdp.yaml").write_text(STOCK_FSDP)
    done = subprocess.run(
        [sys.executable, "-m", "retarget", "launch", "--config_file", str(tmp_path / "fsdp.yaml"),
         str(SCRIPTS / "from_pretrained_fsdp.py"), str(tmp_path / "model"), "--others-on-meta"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launched target fsdp[cpu_ram_efficient_loading=true]" in done.stderr
    # two ranks' lines can meet on one line of the launcher's output
    decode = json.JSONDecoder().raw_decode
    rows = sorted((decode(part)[0] for part in done.stdout.split("SEEN ")[1:]),
                  key=lambda row: row["rank"])  # fmt: skip
    assert [row["rank"] for row in rows] == [0, 1], done.stdout
    assert [row["on_meta"] for row in rows] == [False, True]
    assert rows[0]["equal"], "the sharded model does not hold the checkpoint's weights"
    assert all(row["env"] == "true" for row in rows), "transformers' variable is not exported"
    losses = rows[0]["losses"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert rows[1]["losses"] == losses
