"""Experiment tracking in the shape of Accelerate's by_feature/tracking.py, plus the process
helpers (main_process_first, on_main_process, split_between_processes), with
`from retarget import Accelerator` (the only line that differs from the Accelerate version).

A small classifier on synthetic data. The main process "downloads" the dataset first (writes a
cache file) and the others read it; every epoch logs accuracy, train loss (a tensor) and the
epoch to the trackers in `log_with="all"` (TensorBoard and JSON lines here); a function
decorated with on_main_process writes a summary once; split_between_processes gives each
process its share of a list. tests/compat/accelerate/test_accelerator.py reads the event files back.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retarget import Accelerator


def cached_dataset(path, n):
    """The dataset from `path`, created there first if it is not yet (a stand-in download)."""
    if os.path.exists(path):
        return torch.load(path, weights_only=True), "loaded"
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(n, 8, generator=generator)
    labels = (features[:, 0] + features[:, 1] > 0).long()
    torch.save((features, labels), path)
    return (features, labels), "created"


def training_function(config, args):
    accelerator = Accelerator(
        cpu=args.cpu, log_with="all" if args.with_tracking else None, project_dir=args.project_dir
    )
    torch.manual_seed(config["seed"])
    with accelerator.main_process_first():
        (features, labels), how = cached_dataset(os.path.join(args.project_dir, "data.pt"), 120)
    print(f"process {accelerator.process_index} {how} the dataset")
    train_dataloader = DataLoader(
        TensorDataset(features[:96], labels[:96]), batch_size=config["batch_size"], shuffle=True
    )
    eval_dataloader = DataLoader(
        TensorDataset(features[96:], labels[96:]), batch_size=config["batch_size"]
    )
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    if args.with_tracking:
        accelerator.init_trackers("tracking", config)

    for epoch in range(config["num_epochs"]):
        model.train()
        total_loss = 0
        for inputs, targets in train_dataloader:
            loss = F.cross_entropy(model(inputs), targets)
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

        model.eval()
        correct = seen = 0
        for inputs, targets in eval_dataloader:
            with torch.no_grad():
                predictions = model(inputs).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, targets))
            correct += (predictions == references).sum().item()
            seen += references.numel()
        accuracy = correct / seen
        accelerator.print(f"epoch {epoch}: accuracy {accuracy!r} loss {total_loss.item()!r}")
        if args.with_tracking:
            accelerator.log(
                {"accuracy": accuracy, "train_loss": total_loss, "epoch": epoch}, step=epoch
            )

    @accelerator.on_main_process
    def write_summary(final_accuracy):
        path = os.path.join(args.project_dir, "summary.json")
        with open(path, "a") as f:
            f.write(json.dumps({"accuracy": final_accuracy}) + "\n")

    write_summary(accuracy)
    prompts = ["a", "b", "c", "d", "e"]
    with accelerator.split_between_processes(prompts) as mine:
        print(f"process {accelerator.process_index} takes {mine}")
    if args.with_tracking:
        accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--project_dir", type=str, default="logs")
    args = parser.parse_args()
    config = {"lr": 0.5, "num_epochs": 3, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
