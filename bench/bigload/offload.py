"""One variant of the offload benchmark in a fresh process; prints one JSON line.

    python bench/bigload/offload.py VARIANT CHECKPOINT_FOLDER WORK_FOLDER

Generation (greedy, TOKENS new tokens after a PROMPT-token prompt), budget BUDGET of CPU memory:
memory:       the model held fully in memory (plain construction + load_state_dict), the reference
ours:         retarget.init_empty_weights + load_checkpoint_and_dispatch(device_map="auto",
              max_memory={"cpu": BUDGET}, offload_folder), prefetch=0
ours_prefetch the same with prefetch=1
accelerate:   Accelerate 1.15's init_empty_weights + load_checkpoint_and_dispatch, same arguments

Cold-cache forward (a long prompt, so a block computes at least as long as it loads), ours only:
coldN         prefetch N: a forward with the offloaded files' pages in the page cache (warm),
              then forwards after dropping them (posix_fadvise DONTNEED, with every map closed)

Figures: peak anonymous RSS growth (RssAnon sampled every 2 ms: what the process holds, page
cache excluded) and peak RSS growth (VmHWM, mapped file pages included) from before
construction, seconds per new token, the tokens; for cold*: warm and cold forward seconds.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from load import AnonPeak, status
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

import retarget
from retarget.core.slots import OFFLOAD

BUDGET = "70MB"
PROMPT, TOKENS = 32, 16
COLD_PROMPT = 384


def prompt(length: int) -> torch.Tensor:
    return torch.randint(0, 8000, (1, length), generator=torch.Generator().manual_seed(0))


def build(variant: str, folder: Path, work: Path, config):
    if variant == "memory":
        model = LlamaForCausalLM(config)
        model.load_state_dict(load_file(folder / "model.safetensors"))
        return model
    if variant == "accelerate":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        with init_empty_weights():
            model = LlamaForCausalLM(config)
        return load_checkpoint_and_dispatch(
            model, folder, device_map="auto", max_memory={"cpu": BUDGET}, offload_folder=work
        )
    with retarget.init_empty_weights():
        model = LlamaForCausalLM(config)
    prefetch = int(variant[4:]) if variant.startswith("cold") else int(variant == "ours_prefetch")
    return retarget.load_checkpoint_and_dispatch(
        model,
        folder,
        device_map="auto",
        max_memory={"cpu": BUDGET},
        offload_folder=work,
        prefetch=prefetch,
    )


def drop_page_cache(model) -> None:
    """Close every map of the offloaded files, then ask the kernel to drop their pages."""
    runtime = OFFLOAD.get(model)
    runtime.release()
    gc.collect()
    files = {t.source.record.file for u in runtime.units for t in u.tensors}
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def cold(model) -> dict:
    ids = prompt(COLD_PROMPT)

    def forward() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model(ids)
        return time.perf_counter() - start

    forward()
    warm = statistics.median(forward() for _ in range(3))
    colds = []
    for _ in range(3):
        drop_page_cache(model)
        colds.append(forward())
    return {"warm_seconds": warm, "cold_seconds": statistics.median(colds)}


def main(variant: str, folder: Path, work: Path) -> None:
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(folder)
    config.use_cache = True  # generate as users do, with its KV cache
    with retarget.init_empty_weights():
        LlamaForCausalLM(config)  # warm the imports
    rss0, anon0 = status("VmRSS"), status("RssAnon")
    with AnonPeak() as anon:
        start = time.perf_counter()
        model = build(variant, folder, work, config).eval()
        load_seconds = time.perf_counter() - start
        out: dict = {"variant": variant, "load_seconds": load_seconds}
        if variant.startswith("cold"):
            out |= cold(model)
        else:
            ids = prompt(PROMPT)
            mask = torch.ones_like(ids)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
                start = time.perf_counter()
                tokens = model.generate(
                    ids, attention_mask=mask, max_new_tokens=TOKENS, do_sample=False
                )
                out["seconds_per_token"] = (time.perf_counter() - start) / TOKENS
            out["tokens"] = tokens[0, PROMPT:].tolist()
    out["peak_anon_growth"] = anon.peak - anon0
    out["peak_rss_growth"] = status("VmHWM") - rss0
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
