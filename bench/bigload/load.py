"""One variant of the load benchmark in a fresh process; prints one JSON line.

    python bench/bigload/load.py {plain|empty_init|empty_init_mmap|accelerate} CHECKPOINT_FOLDER

plain:      LlamaForCausalLM(config) (random init) + load_state_dict(safetensors load_file(...))
empty_init: retarget.init_empty_weights() + retarget.load_checkpoint_in_model(model, folder)
empty_init_mmap: the same with mmap=True (weights left backed by the file's memory map)
accelerate: the same with Accelerate's init_empty_weights + load_checkpoint_in_model
            (device_map={"": "cpu"}), the peer

Figures: seconds from before construction to a loaded model; then every weight is summed once
(so that weights backed by the file's memory map are read in), and: peak RSS growth (VmHWM minus
VmRSS before construction, file-mapped pages included) and peak anonymous RSS growth (RssAnon
sampled every 2 ms in a thread: memory the process itself holds, page cache excluded).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

import retarget


def status(field: str) -> int:
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class AnonPeak:
    def __init__(self) -> None:
        self.peak = status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, status("RssAnon"))

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status("RssAnon"))


def main(variant: str, folder: Path) -> None:
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(folder)
    # Warm the constructors' imports so that neither variant pays them.
    with retarget.init_empty_weights():
        LlamaForCausalLM(config)
    rss0, anon0 = status("VmRSS"), status("RssAnon")
    with AnonPeak() as anon:
        start = time.perf_counter()
        if variant == "plain":
            model = LlamaForCausalLM(config)
            model.load_state_dict(load_file(folder / "model.safetensors"))
        elif variant in ("empty_init", "empty_init_mmap"):
            with retarget.init_empty_weights():
                model = LlamaForCausalLM(config)
            retarget.load_checkpoint_in_model(model, folder, mmap=variant == "empty_init_mmap")
        elif variant == "accelerate":
            from accelerate import init_empty_weights
            from accelerate.utils import load_checkpoint_in_model

            with init_empty_weights():
                model = LlamaForCausalLM(config)
            # device_map=None takes torch.distributed.checkpoint's path, which needs a process
            # group on torch 2.13 (docs/facts.md); {"": "cpu"} loads tensor by tensor.
            load_checkpoint_in_model(model, folder, device_map={"": "cpu"})
        else:
            raise SystemExit(f"unknown variant {variant!r}")
        seconds = time.perf_counter() - start
        # Use every weight once: a tensor backed by the file's memory map has its pages read
        # (and counted) only now.
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.sum()
    peak_rss = status("VmHWM")  # before the checksum below allocates its own copy
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    check = float(model.lm_head.weight.double().sum())
    print(
        json.dumps(
            {
                "variant": variant,
                "seconds": seconds,
                "peak_rss_growth": peak_rss - rss0,
                "peak_anon_growth": anon.peak - anon0,
                "weights_bytes": weights,
                "checksum": check,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
