"""One arm of bench/test_quant.py's loading benchmark, in a fresh process: load a checkpoint
quantized to nf4 and print JSON with the peak resident memory the load added and the size of the
loaded model.

    python bench/quant/load_rss.py ours|accelerate|plain CHECKPOINT [DEVICE_MAP]

DEVICE_MAP (default none: where the function puts it) is passed to both functions as is
("auto" on the GPU machine: bench/quant/load_compare.py); on a GPU the output also has the
peak GPU memory the load allocated.

- ours: `init_empty_weights` + `retarget.utils.load_and_quantize_model` (tensor by tensor);
- accelerate: the same call through `accelerate.utils` (it needs bitsandbytes and a GPU);
- plain: the model built with its weights, `load_state_dict` of the whole checkpoint, then
  `load_and_quantize_model` on the loaded model (what the empty-init path avoids).

The peak is the process's high-water mark (VmHWM) after resetting it just before the load
(`/proc/self/clear_refs`), minus the resident memory at that moment.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(arm: str, checkpoint: str, device_map: str | None = None) -> dict:
    config = AutoConfig.from_pretrained(checkpoint)
    if arm == "accelerate":
        from accelerate import init_empty_weights
        from accelerate.utils import BnbQuantizationConfig, load_and_quantize_model
    else:
        from retarget.bigmodel.empty_init import init_empty_weights
        from retarget.utils import BnbQuantizationConfig, load_and_quantize_model
    settings = BnbQuantizationConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="fp32"
    )
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _status("VmRSS")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        if arm == "plain":
            from safetensors.torch import load_file

            from retarget.bigmodel.checkpoint_files import find_checkpoint

            model = AutoModelForCausalLM.from_config(config)
            state = {}
            for path in find_checkpoint(checkpoint).files():
                state.update(load_file(path))
            model.load_state_dict(state)
            del state
            model = load_and_quantize_model(model, settings, device_map=device_map)
        else:
            model = load_and_quantize_model(
                skeleton, settings, weights_location=checkpoint, device_map=device_map
            )
    except Exception as err:  # noqa: BLE001 - an arm that refuses is a result
        return {"arm": arm, "refused": " ".join(f"{type(err).__name__}: {err}".split())[:300]}
    peak = _status("VmHWM") - before
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    found = {
        "arm": arm,
        "peak_added_bytes": peak,
        "model_bytes": size,
        "threads": torch.get_num_threads(),
        "devices": sorted({str(t.device) for t in tensors.values()}),
    }
    if cuda:
        found["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return found


if __name__ == "__main__":
    try:
        print(json.dumps(main(*sys.argv[1:4])))
    except Exception:
        traceback.print_exc()
        sys.exit(1)
