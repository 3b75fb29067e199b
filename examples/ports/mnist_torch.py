"""pytorch/examples ``mnist/main.py``, shrunk to seconds: Adadelta + StepLR per epoch.

Changed from the original: the data (generated 12x12 "digits" instead of downloading
MNIST), the layer sizes (to match), the dropout rates are arguments (the equality test
runs with 0: torch's and JAX's random masks differ), ``--double`` runs in float64, and
``main`` returns the per-step losses and the final weights. The rest is the original.
"""

from __future__ import annotations

import argparse

import synthetic
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR


class Net(nn.Module):
    def __init__(self, dropout1=0.25, dropout2=0.5):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(dropout1)
        self.dropout2 = nn.Dropout(dropout2)
        self.fc1 = nn.Linear(128, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(args, model, device, train_loader, optimizer, epoch, losses):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if batch_idx % args.log_interval == 0:
            print(
                "Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                    epoch,
                    batch_idx * len(data),
                    len(train_loader.dataset),
                    100.0 * batch_idx / len(train_loader),
                    loss.item(),
                )
            )


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)}\n")
    return test_loss


def parse(argv=None):
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (shrunk)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--test-batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--dropout", type=float, nargs=2, default=(0.25, 0.5))
    parser.add_argument("--double", action="store_true", help="float64 throughout")
    return parser.parse_args(argv)


def data(args):
    x, y = synthetic.images(args.n_train + 32, 12, seed=args.seed)
    return (x[: args.n_train], y[: args.n_train]), (x[args.n_train :], y[args.n_train :])


def main(argv=None):
    args = parse(argv)
    torch.set_default_dtype(torch.float64 if args.double else torch.float32)
    device = torch.device("cpu")
    torch.manual_seed(args.seed)

    dtype = torch.get_default_dtype()
    (xt, yt), (xv, yv) = data(args)
    dataset1 = torch.utils.data.TensorDataset(torch.from_numpy(xt).to(dtype), torch.from_numpy(yt))
    dataset2 = torch.utils.data.TensorDataset(torch.from_numpy(xv).to(dtype), torch.from_numpy(yv))
    train_loader = torch.utils.data.DataLoader(dataset1, batch_size=args.batch_size)
    test_loader = torch.utils.data.DataLoader(dataset2, batch_size=args.test_batch_size)

    model = Net(*args.dropout).to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    losses, test_losses = [], []
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch, losses)
        test_losses.append(test(model, device, test_loader))
        scheduler.step()
    torch.set_default_dtype(torch.float32)
    return {"losses": losses, "test_losses": test_losses, "params": dict(model.named_parameters())}


if __name__ == "__main__":
    main()
