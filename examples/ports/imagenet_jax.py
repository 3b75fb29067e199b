"""The JAX port of ``imagenet_torch.py``: facade SGD and StepLR, stepped once per epoch.

Line for line: ``torch.optim.SGD(model.parameters(), lr, momentum=..., weight_decay=...)``
-> ``functorch_optim.optim.SGD(params, lr, momentum=..., weight_decay=...)``;
``StepLR(optimizer, step_size, gamma)`` -> ``functorch_optim.optim.lr_scheduler.StepLR``
with the same arguments and the same ``scheduler.step()`` after each epoch. The
cross-entropy is ``log_softmax`` + ``nll``; the weights start equal (``interop.torch``).
"""

from __future__ import annotations

import imagenet_torch
import jax
import jax.numpy as jnp
import jaxnn as F
import numpy as np
import synthetic
import torch

from functorch_optim.interop.torch import tree_from_module
from functorch_optim.optim import SGD
from functorch_optim.optim.lr_scheduler import StepLR


def model(p, x):
    x = F.max_pool2d(jax.nn.relu(F.batch_norm(p["bn1"], F.conv2d(p["conv1"], x, 1, 1))), 2)
    x = jax.nn.relu(F.conv2d(p["conv2"], x, 1, 1))
    return F.linear(p["fc"], jnp.mean(x, axis=(2, 3)))


def criterion(params, images, target):
    output = model(params, images)
    return F.cross_entropy(output, target), output


def accuracy(output, target, k=1):
    top = jnp.argsort(-output, axis=1)[:, :k]
    return 100.0 * float(jnp.mean(jnp.any(top == target[:, None], axis=1)))


def train(train_data, optimizer, epoch, args, losses):
    for i, (images, target) in enumerate(synthetic.batches(*train_data, args.batch_size)):
        # compute output, gradient, and do SGD step
        optimizer.zero_grad()
        loss, output = optimizer.backward(criterion, images, target, has_aux=True)
        optimizer.step()
        losses.append(float(loss))
        print(f"Epoch: [{epoch}][{i}] Loss {float(loss):.4e} Acc@1 {accuracy(output, target):6.2f}")


def validate(val_data, params, args):
    top1, n = 0.0, 0
    for images, target in synthetic.batches(*val_data, args.batch_size):
        top1 += accuracy(jax.jit(model)(params, images), target) * len(images)
        n += len(images)
    print(f" * Acc@1 {top1 / n:.3f}")
    return top1 / n


def main(argv=None):
    args = imagenet_torch.parse(argv)
    if args.double:
        jax.config.update("jax_enable_x64", True)
    dtype = np.float64 if args.double else np.float32
    torch.set_default_dtype(torch.float64 if args.double else torch.float32)
    torch.manual_seed(args.seed)
    params = tree_from_module(imagenet_torch.TinyNet())  # the torch model's initial weights
    torch.set_default_dtype(torch.float32)
    (xt, yt), (xv, yv) = imagenet_torch.data(args)

    optimizer = SGD(params, args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=args.lr_step, gamma=0.1)

    losses, lrs = [], []
    for epoch in range(args.epochs):
        train((xt.astype(dtype), yt), optimizer, epoch, args, losses)
        validate((xv.astype(dtype), yv), optimizer.params, args)
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return {"losses": losses, "lrs": lrs, "params": optimizer.params}


if __name__ == "__main__":
    main()
