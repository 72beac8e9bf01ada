"""The classic MNIST DataParallel tutorial's loop through paratrain: the same script on one device or many.

    python examples/mnist_parallel.py                                        # one GPU, or the CPU
    python examples/mnist_parallel.py --strategy dp --devices cpu,cpu,cpu    # dp: three CPU replicas, one process
    python examples/mnist_parallel.py --strategy dp --devices cuda:0,cuda:1  # dp: two GPUs, one process
    paratrain launch --nproc-per-node 2 examples/mnist_parallel.py           # ddp: one process per GPU (or CPU)
    paratrain launch --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29400 examples/mnist_parallel.py

--strategy auto (the default) picks ddp under a launcher, dp for a list of devices, else one device. Every run
gives the same model as mnist_single.py; the difference between the two scripts is the few lines paratrain asks
for.
"""

import argparse

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.training.datasets import load_dataset
from paratrain.training.models import SimpleNet

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", default="digits")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--strategy", default="auto", choices=["auto", "single", "dp", "ddp"])
parser.add_argument("--devices", default="auto")
args = parser.parse_args()

torch.manual_seed(0)
data = load_dataset(args.dataset)
train_loader = DataLoader(
    TensorDataset(data.train.inputs, data.train.targets), batch_size=args.batch_size, shuffle=True
)

par = paratrain.Parallel(strategy=args.strategy, devices=args.devices)
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
par.print(f"Test accuracy: {accuracy:.2%} with {par.describe()}")
par.close()
