"""A transformers fine-tuning start as users write it against Accelerate: Accelerator first,
then the model, an optimizer on it, prepare, a few steps.

    retarget launch --config_file fsdp.yaml from_pretrained_fsdp.py MODEL_FOLDER [--others-on-meta]

The main process loads the checkpoint with from_pretrained; the others do too, or with
--others-on-meta build the model from its config on the meta device (the way to load on rank 0
only that cpu_ram_efficient_loading allows). Prints one `SEEN {json}` line per rank: the
environment transformers reads, whether this rank's weights were on the meta device, whether
the prepared model's full weights equal the checkpoint file (main process), and the losses.
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM

from retarget import Accelerator

folder = Path(sys.argv[1])
accelerator = Accelerator()
if accelerator.is_main_process or "--others-on-meta" not in sys.argv:
    model = AutoModelForCausalLM.from_pretrained(folder)
else:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
on_meta = any(p.is_meta for p in model.parameters())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
loader = DataLoader(TensorDataset(ids), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
state = accelerator.get_state_dict(model)
equal = None
if accelerator.is_main_process:
    saved = load_file(folder / "model.safetensors")
    equal = sorted(k for k in saved if torch.equal(saved[k], state[k])) == sorted(saved)
losses = []
for (batch,) in loader:
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(accelerator.gather(loss.detach()).mean().item())
env = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
row = {"rank": accelerator.process_index, "env": env, "on_meta": on_meta, "equal": equal}
row["losses"] = losses
print("SEEN " + json.dumps(row), flush=True)
