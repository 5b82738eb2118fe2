"""Launched by tests/launch/test_faults.py: train under the launched target, checkpoint every EVERY
steps, resume from the newest intact checkpoint after a restart.

    elastic_train.py OUT STEPS EVERY KILL_AT

With KILL_AT >= 0, rank 1 SIGKILLs itself right after step KILL_AT on the first attempt
(TORCHELASTIC_RESTART_COUNT=0): the launcher's elastic agent restarts every rank, which resume
and finish. With PREEMPTIBLE=1 it watches for SIGTERM/SIGUSR1, prints `STEP n` after each step
(slowed to 0.1 s) and, when asked, saves and exits 0. With HANG_AT=n rank 1 sleeps forever at
step n. Rank 0 writes OUT/final.safetensors
(full weights) and OUT/attempts.txt.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import retarget
from retarget.execution.process import ProcessState
from retarget.runtime.state.checkpoint import ProjectConfig, resume_from_latest, save_state
from retarget.runtime.state.save_model import get_state_dict

out, steps, every, kill_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
state = ProcessState.current()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
)
compiled = retarget.compile_for(model, example_inputs=(torch.randn(4, 8),))
optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
project = ProjectConfig(project_dir=out, total_limit=2)
point = resume_from_latest(project, model=compiled, optimizers=[optimizer])
start = point.step if point is not None else 0
preemption = retarget.watch_preemption() if os.environ.get("PREEMPTIBLE") == "1" else None
for step in range(start, steps):
    data = torch.Generator().manual_seed(1000 * step + state.rank)  # a batch per step and rank
    x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
    loss = torch.nn.functional.mse_loss(compiled(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if (step + 1) % every == 0:
        save_state(model=compiled, optimizers=[optimizer], step=step + 1, project=project)
    if step == int(os.environ.get("HANG_AT", "-1")) and state.rank == 1:
        time.sleep(10**6)  # stuck outside any collective: the others time out waiting
    if step == kill_at and state.rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if preemption is not None:
        print(f"STEP {step + 1}", flush=True)
        time.sleep(0.1)
        if preemption.should_stop():
            preemption.exit_after(
                lambda step=step: save_state(
                    model=compiled, optimizers=[optimizer], step=step + 1, project=project
                )
            )
weights = get_state_dict(compiled)
if state.rank == 0:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "final.safetensors")
    (out / "attempts.txt").write_text(f"{attempt}\n{start}\n")
