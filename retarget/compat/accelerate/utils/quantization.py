"""Accelerate's `BnbQuantizationConfig` and `load_and_quantize_model`, on retarget's own kernels.

    from retarget.utils import BnbQuantizationConfig, load_and_quantize_model

    config = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(hf_config)
    model = load_and_quantize_model(model, config, weights_location="checkpoint/")

The config keeps Accelerate's fields, defaults and checks. The model comes back with
retarget's `QuantizedLinear` (nf4/fp4 with block scales, or int8 per row: the formats of the
`quant` target part) where Accelerate puts bitsandbytes' Linear4bit/Linear8bitLt, loaded one
tensor at a time (`bigmodel/load_quantized.py`). Differences, each said when it applies:
- it runs on the CPU too (Accelerate requires a GPU); bitsandbytes is not needed;
- 8-bit is weight-only int8 without LLM.int8's outlier split: `llm_int8_threshold` other than
  its default warns that it is ignored;
- `device_map` may put the whole model on one device ("auto": the GPU when there is one);
  a map over several devices, or offload to disk, is refused by name (use `dispatch_model`
  on the result, or retarget's `stream` target).
The model gets `is_loaded_in_4bit` / `is_loaded_in_8bit` as Accelerate sets them (PEFT reads
them). Train it with LoRA through `compile_for(peft_model, "fsdp+bf16")` and the like.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from retarget.bigmodel.load_quantized import QuantizeSettings, quantize_model
from retarget.core.errors import TargetNotSupportedError

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    raise ValueError(f"{what} must be in ['fp32','fp16','bf16'] or a torch.dtype, got {value!r}")


@dataclass
class BnbQuantizationConfig:
    """Accelerate's quantization settings (its fields and defaults)."""

    load_in_8bit: bool = False
    llm_int8_threshold: float = 6.0
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: Any = "fp16"
    torch_dtype: Any = None
    skip_modules: list[str] | None = None
    keep_in_fp32_modules: list[str] | None = None
    target_dtype: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        for name in ("load_in_8bit", "load_in_4bit", "bnb_4bit_use_double_quant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit can't be both True")
        if not self.load_in_4bit and not self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit can't be both False")
        if not isinstance(self.llm_int8_threshold, (int, float)):
            raise ValueError("llm_int8_threshold must be a float or an int")
        if self.bnb_4bit_quant_type not in ("fp4", "nf4"):
            raise ValueError(
                f"bnb_4bit_quant_type must be in ['fp4','nf4'] but found {self.bnb_4bit_quant_type}"
            )
        self.bnb_4bit_compute_dtype = _dtype(self.bnb_4bit_compute_dtype, "bnb_4bit_compute_dtype")
        self.torch_dtype = _dtype(self.torch_dtype, "torch_dtype")
        for name in ("skip_modules", "keep_in_fp32_modules"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), list):
                raise ValueError(f"{name} must be a list of strings")
        self.target_dtype = "int4" if self.load_in_4bit else torch.int8
        if self.torch_dtype is None:  # Accelerate's defaults for the unquantized tensors
            self.torch_dtype = torch.float16 if self.load_in_8bit else self.bnb_4bit_compute_dtype
        if self.load_in_4bit and self.llm_int8_threshold != 6.0:
            warnings.warn(
                "llm_int8_threshold can only be used for model loaded in 8bit", stacklevel=2
            )

    def settings(self) -> QuantizeSettings:
        """The same choices as retarget's quantization settings."""
        if self.load_in_8bit and self.llm_int8_threshold != 6.0:
            warnings.warn(
                f"llm_int8_threshold={self.llm_int8_threshold} is LLM.int8's outlier threshold; "
                "retarget's int8 is weight-only with a scale per row (no outlier split), so it "
                "is ignored",
                stacklevel=3,
            )
        four = self.load_in_4bit
        return QuantizeSettings(
            format=self.bnb_4bit_quant_type if four else "int8",
            double_quant=self.bnb_4bit_use_double_quant and four,
            compute_dtype=self.bnb_4bit_compute_dtype if four else self.torch_dtype,
            dtype=self.torch_dtype,
            skip=tuple(self.skip_modules or ()),
            keep_fp32=tuple(self.keep_in_fp32_modules or ()),
        )


def load_and_quantize_model(
    model: nn.Module,
    bnb_quantization_config: BnbQuantizationConfig,
    weights_location: Any = None,
    device_map: Any = None,
    no_split_module_classes: list[str] | None = None,
    max_memory: dict | None = None,
    offload_folder: Any = None,
    offload_state_dict: bool = False,
) -> nn.Module:
    """Quantize `model` (loading `weights_location` when it is on the meta device) and put it
    on the device `device_map` names; returns it. See the module docstring for what differs
    from Accelerate."""
    device = _one_device(device_map, max_memory, offload_folder, offload_state_dict)
    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        warnings.warn(
            "It is not recommended to quantize a loaded model: the float weights and the "
            "quantized ones exist together until the swap. Build the model under "
            "init_empty_weights() and give weights_location",
            stacklevel=2,
        )
    settings = bnb_quantization_config.settings()
    location = None if weights_location is None else str(weights_location)
    quantize_model(model, settings, location if on_meta else None)
    model.is_loaded_in_4bit = bnb_quantization_config.load_in_4bit
    model.is_loaded_in_8bit = bnb_quantization_config.load_in_8bit
    del no_split_module_classes  # one device: nothing is split
    return model.to(device) if device is not None else model


def _one_device(device_map: Any, max_memory, offload_folder, offload_state_dict) -> Any:
    """The single device `device_map` puts everything on (None: leave it where it is)."""
    if device_map is None:
        return None
    if device_map == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device_map, (str, int, torch.device)) and device_map not in ("disk",):
        if device_map in ("balanced", "balanced_low_0", "sequential"):
            return _refuse(f"device_map={device_map!r}")
        return device_map
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) == 1 and "disk" not in devices:
            return next(iter(devices))
    return _refuse(f"device_map={device_map!r}")


def _refuse(what: str) -> Any:
    raise TargetNotSupportedError(
        f"load_and_quantize_model({what}): a map over several devices or to disk is not "
        "implemented for quantized models; load onto one device (device_map=None, 'auto', "
        "'cpu' or 'cuda:0'), then dispatch_model the result or use the stream target"
    )
