"""The classic MNIST DataParallel tutorial's loop on one device: SimpleNet, CrossEntropyLoss, SGD(lr=0.01),
batch 64, 5 epochs.

    python examples/mnist_single.py                      # digits (offline), the tutorial's settings
    python examples/mnist_single.py --dataset mnist      # the real MNIST IDX files (downloaded if missing)

Compare with mnist_parallel.py: the difference is the few lines paratrain asks for.
"""

import argparse

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

from paratrain.training.datasets import load_dataset
from paratrain.training.models import SimpleNet

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", default="digits")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=64)
args = parser.parse_args()

torch.manual_seed(0)
data = load_dataset(args.dataset)
train_loader = DataLoader(
    TensorDataset(data.train.inputs, data.train.targets), batch_size=args.batch_size, shuffle=True
)

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = SimpleNet().to(device)
criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD(model.parameters(), lr=0.01)

for epoch in range(args.epochs):
    for i, (images, labels) in enumerate(train_loader):
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        outputs = model(images)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()
        if i % 100 == 0:
            print(f"Epoch {epoch}, Step {i}, Loss: {loss.item()}")

model.eval()
with torch.no_grad():
    predicted = model(data.test.inputs.to(device)).argmax(dim=1)
accuracy = (predicted == data.test.targets.to(device)).float().mean().item()
print(f"Test accuracy: {accuracy:.2%}")
