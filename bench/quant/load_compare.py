"""Quantized loading, ours against Accelerate's, on one checkpoint: the GPU check's arm
(bench/gpu/run.sh), since Accelerate's `load_and_quantize_model` refuses to run without a GPU.

    python bench/quant/load_compare.py [--dry-run] --out DIR

Writes a sharded safetensors Llama checkpoint (float32; h1024, 4 layers, vocab 2048 as in
bench/test_quant.py; a tiny one under --dry-run), loads it quantized to nf4 by each function in
a fresh process (bench/quant/load_rss.py, `device_map="auto"`: the GPU when there is one), and
writes DIR/quant_load.json: per arm the peak host memory the load added, the loaded model's
bytes and devices, the peak GPU memory, or the refusal. bitsandbytes is Accelerate's backend:
without it (or without a GPU) its arm records the refusal and the run still succeeds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def checkpoint(folder: Path, dry_run: bool) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256)
        if dry_run
        else dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, vocab_size=2048)
    )
    torch.manual_seed(0)
    config = LlamaConfig(**sizes, num_attention_heads=16 if not dry_run else 4)
    shard = "100KB" if dry_run else "50MB"
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=shard)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    return f"Llama {sizes}, float32, {len(files)} safetensors shards"


def arm(name: str, folder: Path) -> dict:
    done = subprocess.run(
        [sys.executable, str(HERE / "load_rss.py"), name, str(folder), "auto"],
        capture_output=True,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"arm": name, "failed": (done.stderr or done.stdout)[-1500:]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny checkpoint (CPU check)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"
        described = checkpoint(folder, args.dry_run)
        arms = {name: arm(name, folder) for name in ("ours", "accelerate")}
    ratios = {
        name: round(r["peak_added_bytes"] / r["model_bytes"], 2)
        for name, r in arms.items()
        if "peak_added_bytes" in r
    }
    report = {
        "checkpoint": described,
        "quantization": "nf4, compute fp32 (BnbQuantizationConfig), device_map='auto'",
        "arms": arms,
        "peak host memory added / loaded model bytes": ratios,
        "dry_run": args.dry_run,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_load.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 1 if "peak_added_bytes" not in arms["ours"] else 0


if __name__ == "__main__":
    sys.exit(main())
