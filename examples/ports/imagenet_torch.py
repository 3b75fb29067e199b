"""pytorch/examples ``imagenet/main.py``, shrunk to seconds: SGD + StepLR, one step per epoch.

Changed from the original: a tiny conv net (conv-BN-ReLU-pool, conv-ReLU, global average
pool, linear) instead of a torchvision ResNet, generated 8x8 RGB images instead of an
ImageFolder, ``--lr-step`` (30 in the original) so that the decay happens within a few
epochs, no distributed/AMP/checkpoint branches, ``--double`` for float64, and ``main``
returns the per-step losses and the final weights. The optimizer, the scheduler, the
criterion and ``train``/``validate``/``accuracy`` follow the original.
"""

from __future__ import annotations

import argparse

import synthetic
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR


def parse(argv=None):
    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (shrunk)")
    parser.add_argument("--epochs", default=3, type=int)
    parser.add_argument("-b", "--batch-size", default=8, type=int)
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, dest="lr")
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--lr-step", default=1, type=int, help="StepLR's step_size (30 in the original)")
    parser.add_argument("--n-train", default=32, type=int)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--double", action="store_true", help="float64 throughout")
    return parser.parse_args(argv)


class TinyNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def data(args):
    x, y = synthetic.images(args.n_train + 16, 8, channels=3, seed=args.seed)
    return (x[: args.n_train], y[: args.n_train]), (x[args.n_train :], y[args.n_train :])


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


def train(train_loader, model, criterion, optimizer, epoch, args, losses):
    model.train()
    for i, (images, target) in enumerate(train_loader):
        # compute output
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"Epoch: [{epoch}][{i}/{len(train_loader)}] Loss {loss.item():.4e} Acc@1 {acc1.item():6.2f}")


def validate(val_loader, model, criterion, args):
    model.eval()
    top1, n = 0.0, 0
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            top1 += acc1.item() * images.size(0)
            n += images.size(0)
    print(f" * Acc@1 {top1 / n:.3f}")
    return top1 / n


def main(argv=None):
    args = parse(argv)
    torch.set_default_dtype(torch.float64 if args.double else torch.float32)
    dtype = torch.get_default_dtype()
    torch.manual_seed(args.seed)
    model = TinyNet()
    (xt, yt), (xv, yv) = data(args)
    train_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(xt).to(dtype), torch.from_numpy(yt)),
        batch_size=args.batch_size,
    )
    val_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(xv).to(dtype), torch.from_numpy(yv)),
        batch_size=args.batch_size,
    )

    # define loss function (criterion), optimizer, and learning rate scheduler
    criterion = nn.CrossEntropyLoss()

    optimizer = torch.optim.SGD(
        model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )

    """Sets the learning rate to the initial LR decayed by 10 every 30 epochs"""
    scheduler = StepLR(optimizer, step_size=args.lr_step, gamma=0.1)

    losses, lrs = [], []
    for epoch in range(args.epochs):
        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch, args, losses)
        # evaluate on validation set
        validate(val_loader, model, criterion, args)
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    torch.set_default_dtype(torch.float32)
    return {"losses": losses, "lrs": lrs, "params": dict(model.named_parameters())}


if __name__ == "__main__":
    main()
