"""A user's causal-LM training loop, the same script with and without pipeline parallelism:
the target comes from the command line (`--target pp` under `retarget launch --num_processes
2`, `--target single` in one process). It loads a Hugging Face checkpoint folder, trains a few
AdamW steps with clipping through `runtime.forward_backward`, evaluates the unwrapped model,
and saves it; rank 0 prints one `RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

import retarget
from retarget.runtime.state.save_model import save_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a save_pretrained folder")
    parser.add_argument("--target", default="single")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", help="save the trained model here")
    args = parser.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.model)
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (4, 16), generator=generator) for _ in range(args.steps)]
    example = {"input_ids": batches[0], "labels": batches[0]}

    compiled = retarget.compile_for(model, args.target, example_inputs=example)
    run = compiled.runtime
    optimizer = run.prepare(torch.optim.AdamW(compiled.parameters(), lr=1e-3))
    losses = []
    for ids in batches:
        loss = run.forward_backward({"input_ids": ids, "labels": ids})
        run.clip_grad_norm_(compiled.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))

    trained = compiled.unwrap().eval()
    with torch.no_grad():
        evaluated = float(trained(input_ids=batches[0], labels=batches[0]).loss)
    if args.out:
        save_model(compiled, args.out)
    if run.is_main_process:
        print("RESULT " + json.dumps({"losses": losses, "eval": evaluated}), flush=True)


if __name__ == "__main__":
    main()
