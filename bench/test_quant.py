"""Quantized fine-tuning (`quant`): training-step time and memory of QLoRA against bf16 LoRA and
full fine-tuning, and the peak memory of loading a checkpoint quantized.

Run: RETARGET_BENCH_ROUNDS=9 python -m pytest bench/test_quant.py --benchmark-only -s

Step time: one AdamW step (forward, loss, backward, step, zero_grad) of a Llama-style model
compiled by `compile_for`, the arms interleaved in every round; ratios of medians against full
fine-tuning in float32 measured in the same run. Memory: the bytes the training state holds
after a step (parameters, gradients, optimizer state), counted from the tensors; and the bytes
autograd saves for backward in one forward beyond the model's own tensors (activations, and
any dequantized copy of a quantized weight a matmul would keep: none since the quantized
matmuls save the packed weight). Arms: full fine-tuning, bf16 LoRA, quant[bits=4] LoRA (ours,
float32 and bf16), quant[bits=4,backend=torchao] LoRA (torchao's NF4Tensor) and
quant[bits=4,backend=bnb] LoRA (bitsandbytes' nf4 and matmul_4bit). On this CPU
the 4-bit arm dequantizes each weight at every call (no fused 4-bit kernel), so it is expected
to be slower than the others here; the figure is its cost on CPU, not GPU speed.

Loading: `bench/quant/load_rss.py` in a fresh process per arm, on a sharded safetensors
checkpoint: the peak resident memory the load adds over the loaded model's bytes (ours: empty
init + load_and_quantize_model; plain: the float model loaded first), and Accelerate's own
`load_and_quantize_model` on the same checkpoint (it needs bitsandbytes and a GPU: on this
machine it refuses, and the table says so). Nothing here asserts on timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import peft
import torch
from common import interleaved_medians, llama, results_file, source_revision, token_batch

from retarget.driver.compile import compile_for

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "5"))
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB = 512, 1376, 4, 8, 1024
BATCH, SEQ = 2, 64
LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: arm -> (LoRA adapters?, target)
ARMS = {
    "full fine-tuning": (False, "single"),
    "bf16 LoRA": (True, "bf16"),
    "quant[bits=4] LoRA": (True, "quant[bits=4]"),
    "bf16+quant[bits=4] LoRA": (True, "bf16+quant[bits=4]"),
    "quant[bits=4,backend=torchao] LoRA": (True, "quant[bits=4,backend=torchao]"),
    "quant[bits=4,backend=bnb] LoRA": (True, "quant[bits=4,backend=bnb]"),
}
RESULTS_FILE = results_file("quant.json")
HERE = Path(__file__).resolve().parent


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state (a tensor subclass's, such as
    torchao's NF4Tensor: its inner tensors', not its logical float size)."""
    from retarget.execution.apply_plan import tensor_parts

    tensors = {id(p): p for p in model.parameters()}
    tensors.update({id(p.grad): p.grad for p in model.parameters() if p.grad is not None})
    for state in optimizer.state.values():
        tensors.update({id(v): v for v in state.values() if isinstance(v, torch.Tensor)})
    parts = [part for t in tensors.values() for part in tensor_parts(t)]
    return sum(t.numel() * t.element_size() for t in parts)


def _saved_bytes(compiled: torch.nn.Module, inputs: dict) -> int:
    """Bytes autograd saves for backward in one training forward, beyond the model's own
    tensors (a saved parameter costs nothing new; a dequantized copy of a weight does)."""
    from retarget.execution.apply_plan import tensor_parts

    def storages(tensor: torch.Tensor) -> set[int]:
        return {part.untyped_storage().data_ptr() for part in tensor_parts(tensor)}

    own = set().union(*(storages(t) for t in [*compiled.parameters(), *compiled.buffers()]))
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not storages(tensor) <= own:
            total[0] += sum(p.numel() * p.element_size() for p in tensor_parts(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = compiled(**inputs).loss
    loss.backward()
    compiled.zero_grad(set_to_none=False)
    return total[0]


def trainer(lora: bool, target: str):
    inputs = token_batch(VOCAB, BATCH, SEQ)
    model = llama(
        layers=LAYERS, hidden=HIDDEN, intermediate=INTERMEDIATE, heads=HEADS, positions=SEQ
    )
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=LORA))
    compiled = compile_for(model, target, example_inputs=inputs)
    trainable = [p for p in compiled.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)

    def one_step() -> None:
        compiled(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: counted as memory

    one_step()  # first call: optimizer moments
    return (
        one_step,
        lambda: _state_bytes(compiled, optimizer),
        lambda: _saved_bytes(compiled, inputs),
    )


def test_qlora_step_time_and_memory(benchmark) -> None:
    built = {name: trainer(*arm) for name, arm in ARMS.items()}
    benchmark.group = "quant step time"
    median = interleaved_medians(
        benchmark, {n: b[0] for n, b in built.items()}, rounds=ROUNDS, threads=THREADS
    )
    memory = {name: b[1]() for name, b in built.items()}
    saved = {name: b[2]() for name, b in built.items()}
    base = "full fine-tuning"
    info = {
        "model": f"Llama h{HIDDEN} i{INTERMEDIATE} {LAYERS} layers, batch {BATCH} seq {SEQ}, "
        f"LoRA r=16 on {len(LORA)} projections",
        "rounds": ROUNDS,
        "threads": THREADS,
        "median_step_seconds": {n: round(v, 4) for n, v in median.items()},
        "step_time_ratios": {f"{n} / {base}": round(median[n] / median[base], 2) for n in ARMS},
        "state_bytes": memory,
        "memory_ratios": {f"{n} / {base}": round(memory[n] / memory[base], 3) for n in ARMS},
        "saved_for_backward_bytes": saved,
        "saved_ratios": {f"{n} / {base}": round(saved[n] / saved[base], 3) for n in ARMS},
        **source_revision(),
    }
    benchmark.extra_info.update(info)
    _write(step=info)
    print("\n" + json.dumps(info, indent=2))


def test_load_and_quantize_peak_memory(benchmark, tmp_path) -> None:
    checkpoint = tmp_path / "checkpoint"
    llama(layers=4, hidden=1024, intermediate=2816, heads=16, vocab=2048).save_pretrained(
        checkpoint, max_shard_size="50MB"
    )
    script = HERE / "quant" / "load_rss.py"
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}

    def arm(name: str) -> dict:
        done = subprocess.run(
            [sys.executable, str(script), name, str(checkpoint)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    results = {}

    def all_arms() -> None:
        for name in ("ours", "plain", "accelerate"):
            results[name] = arm(name)

    benchmark.group = "quantized loading"
    benchmark.pedantic(all_arms, rounds=1, iterations=1)
    ratios = {
        name: round(r["peak_added_bytes"] / r["model_bytes"], 2)
        for name, r in results.items()
        if "refused" not in r
    }
    info = {
        "checkpoint": "Llama h1024 i2816 4 layers vocab 2048, float32, 5 safetensors shards",
        "quantization": "nf4, compute fp32 (BnbQuantizationConfig)",
        "arms": results,
        "peak_added / loaded model bytes": ratios,
        **source_revision(),
    }
    benchmark.extra_info.update(info)
    _write(load=info)
    print("\n" + json.dumps(info, indent=2))


def _write(**parts: dict) -> None:
    current = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.is_file() else {}
    current.update(parts)
    RESULTS_FILE.write_text(json.dumps(current, indent=2) + "\n")
