"""accelerate_mnist.py written with compile_for and the compiled model's runtime, no Accelerator.

tests/compat/accelerate/test_accelerator.py runs both under `retarget launch --num_processes 2` and
compares their printed numbers: the facade must add nothing to what compile_for and the runtime do.
"""

import argparse
import gc

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import retarget
from retarget.compat.accelerate.data_order import AccelerateDraws
from retarget.core.world import launched_target


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n, seed):
    """1x28x28 images of 10 classes, learnable: each class is its own pattern plus noise."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = patterns[labels] + 2.0 * torch.randn(n, 1, 28, 28, generator=generator)
    return TensorDataset(images, labels)


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = retarget.compile_for(Net(), launched_target() or "single")
    run = model.runtime

    with run.main_process_first():
        train_dataset = synthetic_mnist(512, seed=1)
        test_dataset = synthetic_mnist(250, seed=2)
    # AccelerateDraws: shuffled and drawn from the RNG as the Accelerator's prepare does
    train = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True)
    train_loader = run.shard(train, order=AccelerateDraws)
    test = DataLoader(test_dataset, batch_size=args.batch_size)
    test_loader = run.shard(test, order=AccelerateDraws)

    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    for epoch in range(1, args.epochs + 1):
        model.train()
        total_loss, batches = 0.0, 0
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            run.backward(loss)
            optimizer.step()
            total_loss += loss.item()
            batches += 1
        train_loss = run.reduce(torch.tensor(total_loss / batches), "mean").item()

        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for data, target in test_loader:
                preds = model(data).argmax(dim=1)
                preds, target = run.gather_for_metrics((preds, target))
                correct += (preds == target).sum().item()
                seen += target.numel()
        if run.is_main_process:
            print(f"Epoch {epoch:02d} / train loss = {train_loss!r}")
        run.print(f"Epoch {epoch:02d} / eval accuracy = {correct / seen!r} on {seen}")
        scheduler.step()

    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    run.print(f"weights checksum = {weights.double().sum().item()!r}")


if __name__ == "__main__":
    main()
    # What the Accelerator does at exit: free the model's DDP state (a model and its runtime
    # refer to each other, so only the collector frees them), then end the process group. Left
    # to interpreter shutdown, they sometimes abort a rank after training succeeded.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
