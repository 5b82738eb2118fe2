"""One fresh process: build a small Qwen2 (default config, sizes shrunk), then time what a user
waits for between `accelerator.prepare(...)` and the end of the first optimizer step, under
Accelerate or retarget (the only difference: which Accelerator is imported). Prints one JSON line.

    python bench/startup/first_step.py --framework retarget [--compile] [--mixed-precision bf16]

With --compile both run regional torch.compile (Accelerate's TorchDynamoPlugin with
use_regional_compilation; retarget's compile part); a warm inductor cache is the caller's
business (run twice with the same TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import json
import time

T0 = time.perf_counter()

import torch  # noqa: E402

T_TORCH = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("accelerate", "retarget"), required=True)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.framework == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import TorchDynamoPlugin
    else:
        from retarget import Accelerator
        from retarget.compat.accelerate.utils import TorchDynamoPlugin
    imported = time.perf_counter()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
    )
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 512, (4, 32))
    kwargs = {}
    if args.compile:
        kwargs["dynamo_plugin"] = TorchDynamoPlugin(
            backend="inductor", use_regional_compilation=True
        )
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision, **kwargs)
    begin = time.perf_counter()
    model, optimizer = accelerator.prepare(model, optimizer)
    prepared = time.perf_counter()
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    first = time.perf_counter()
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    second = time.perf_counter()
    program = getattr(model, "program", None)  # retarget's CompiledModule
    capture = sum(r.capture_seconds for r in program.regions) if program is not None else 0.0
    print(
        json.dumps(
            {
                "framework": args.framework,
                "compile": args.compile,
                "mixed_precision": args.mixed_precision,
                "import_torch_s": T_TORCH - T0,
                "import_framework_s": imported - start,
                "prepare_s": prepared - begin,
                "prepare_to_first_step_s": first - begin,
                "second_step_s": second - first,
                "capture_s": capture,
                "wall_s": second - T0,
            }
        )
    )


if __name__ == "__main__":
    main()
