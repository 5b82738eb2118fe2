"""MNIST in the shape of Accelerate's mnist_example, with `from retarget import Accelerator`.

Run by tests/compat/accelerate/test_accelerator.py under `retarget launch --num_processes 2`. The
only line that differs from the Accelerate version is the import. Synthetic MNIST-shaped data
replaces torchvision's (no downloads in tests); the eval set (250 images) does not split evenly over
2 processes x 32, so gather_for_metrics must drop the wrap-around padding. It prints exact (repr)
numbers so that accelerate_mnist_compile_for.py, the same training written with compile_for and its
runtime, can be compared with it number for number.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from retarget import Accelerator


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
    accelerator = Accelerator()

    with accelerator.main_process_first():
        train_dataset = synthetic_mnist(512, seed=1)
        test_dataset = synthetic_mnist(250, seed=2)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_dataset, batch_size=args.batch_size)

    model = Net().to(accelerator.device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )

    for epoch in range(1, args.epochs + 1):
        model.train()
        total_loss, batches = 0.0, 0
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            accelerator.backward(loss)
            optimizer.step()
            total_loss += loss.item()
            batches += 1
        train_loss = accelerator.reduce(torch.tensor(total_loss / batches), "mean").item()

        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for data, target in test_loader:
                preds = model(data).argmax(dim=1)
                preds, target = accelerator.gather_for_metrics((preds, target))
                correct += (preds == target).sum().item()
                seen += target.numel()
        if accelerator.is_main_process:
            print(f"Epoch {epoch:02d} / train loss = {train_loss!r}")
        accelerator.print(f"Epoch {epoch:02d} / eval accuracy = {correct / seen!r} on {seen}")
        scheduler.step()

    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    accelerator.print(f"weights checksum = {weights.double().sum().item()!r}")


if __name__ == "__main__":
    main()
