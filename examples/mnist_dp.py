"""The second seed's loop on several devices in one process, through paratrain.

    python examples/mnist_dp.py                          # every GPU (DataParallel), or the CPU without one
    python examples/mnist_dp.py --devices cpu,cpu,cpu    # three CPU replicas: the same result as one device

Compare with mnist_single.py: the difference is the few lines paratrain asks for.
"""

import argparse

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.datasets import load_dataset
from paratrain.models import SimpleNet

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", default="digits")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--devices", default="auto")
args = parser.parse_args()

torch.manual_seed(0)
data = load_dataset(args.dataset)
train_loader = DataLoader(
    TensorDataset(data.train.inputs, data.train.targets), batch_size=args.batch_size, shuffle=True
)

par = paratrain.Parallel(strategy="auto", devices=args.devices)
model = SimpleNet()
criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD(model.parameters(), lr=0.01)
model, optimizer, train_loader = par.prepare(model, optimizer, train_loader)

for epoch in range(args.epochs):
    for i, (images, labels) in enumerate(train_loader):
        optimizer.zero_grad()
        outputs = model(images)
        loss = criterion(outputs, labels)
        par.backward(loss)
        optimizer.step()
        if i % 100 == 0:
            par.print(f"Epoch {epoch}, Step {i}, Loss: {loss.item()}")

model.eval()
with torch.no_grad():
    predicted = model(data.test.inputs.to(par.device)).argmax(dim=1)
accuracy = (predicted == data.test.targets.to(par.device)).float().mean().item()
par.print(f"Test accuracy: {accuracy:.2%} with {par.strategy.describe()}")
par.close()
