"""MNIST training in the shape of Accelerate's tutorial: a small CNN, AdamW, two epochs.

mnist_tutorial_accelerate.py is the Accelerate version (kept as text, not run: accelerate is not a
dependency); mnist_tutorial.py is the same script for retarget, run by tests/launch/test_launch.py
under `retarget launch --num_processes 2`, which also checks that the two differ in at most 4 lines.
Synthetic MNIST-shaped data stands in for torchvision's (no downloads in tests); the eval set (250
images) does not split evenly over 2 ranks x 32, so gather_for_metrics must drop the padding.
Imports are not re-sorted, so that the versions differ only where they must.
"""
# ruff: noqa: I001

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, stride=2)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16 * 6 * 6, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(x, 1))


def synthetic_mnist(n, seed):
    """1x28x28 images of 10 classes, learnable: each class is its own pattern plus noise."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = patterns[labels] + 2.0 * torch.randn(n, 1, 28, 28, generator=generator)
    return TensorDataset(images, labels)


def main():
    torch.manual_seed(0)
    model = Net()
    accelerator = Accelerator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_loader = DataLoader(synthetic_mnist(512, seed=1), batch_size=32, shuffle=True)
    eval_loader = DataLoader(synthetic_mnist(250, seed=2), batch_size=32)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )

    for epoch in range(2):
        model.train()
        for images, labels in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()

        model.eval()
        correct = total = 0
        for images, labels in eval_loader:
            with torch.no_grad():
                predictions = model(images).argmax(dim=-1)
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += (predictions == labels).sum().item()
            total += labels.numel()
        if accelerator.is_main_process:
            print(f"epoch {epoch}: accuracy {correct / total:.4f} on {total} images")


if __name__ == "__main__":
    main()
