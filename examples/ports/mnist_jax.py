"""The JAX port of ``mnist_torch.py``: the same loop over the ``torch.optim``-shaped facade.

Line for line: ``optim.Adadelta`` -> ``functorch_optim.optim.Adadelta``, ``StepLR`` ->
``functorch_optim.optim.lr_scheduler.StepLR`` (stepped once per epoch, as in torch),
``loss.backward()`` -> ``optimizer.backward(loss_fn, ...)``. The model is a function of
its parameters, which start equal to the torch model's (``interop.torch``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxnn as F
import mnist_torch
import numpy as np
import synthetic
import torch

from functorch_optim.interop.torch import tree_from_module
from functorch_optim.optim import Adadelta
from functorch_optim.optim.lr_scheduler import StepLR


def net(params, x, dropout=(0.0, 0.0), key=None):
    keys = jax.random.split(key) if key is not None else (None, None)
    x = F.conv2d(params["conv1"], x)
    x = jax.nn.relu(x)
    x = F.conv2d(params["conv2"], x)
    x = jax.nn.relu(x)
    x = F.max_pool2d(x, 2)
    x = F.dropout(x, dropout[0], keys[0])
    x = x.reshape(x.shape[0], -1)
    x = F.linear(params["fc1"], x)
    x = jax.nn.relu(x)
    x = F.dropout(x, dropout[1], keys[1])
    x = F.linear(params["fc2"], x)
    return F.log_softmax(x, axis=1)


def loss_fn(params, data, target, dropout, key):
    return F.nll_loss(net(params, data, dropout, key), target)


def train(args, optimizer, train_data, epoch, losses, key):
    for batch_idx, (data, target) in enumerate(synthetic.batches(*train_data, args.batch_size)):
        key, sub = jax.random.split(key)
        optimizer.zero_grad()
        loss = optimizer.backward(loss_fn, data, target, tuple(args.dropout), sub)
        optimizer.step()
        losses.append(float(loss))
        if batch_idx % args.log_interval == 0:
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_data[0])}]"
                f"\tLoss: {float(loss):.6f}"
            )
    return key


def test(params, test_data, args):
    test_loss, correct = 0.0, 0
    for data, target in synthetic.batches(*test_data, args.test_batch_size):
        output = jax.jit(net)(params, data)
        test_loss += float(F.nll_loss(output, target, reduction="sum"))
        correct += int(jnp.sum(jnp.argmax(output, axis=1) == target))
    test_loss /= len(test_data[0])
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_data[0])}\n")
    return test_loss


def main(argv=None):
    args = mnist_torch.parse(argv)
    if args.double:
        jax.config.update("jax_enable_x64", True)
    dtype = np.float64 if args.double else np.float32
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.float64 if args.double else torch.float32)
    params = tree_from_module(mnist_torch.Net())  # the torch model's initial weights
    torch.set_default_dtype(torch.float32)
    (xt, yt), (xv, yv) = mnist_torch.data(args)
    train_data, test_data = (xt.astype(dtype), yt), (xv.astype(dtype), yv)

    optimizer = Adadelta(params, lr=args.lr)
    losses, test_losses = [], []
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    key = jax.random.PRNGKey(args.seed)
    for epoch in range(1, args.epochs + 1):
        key = train(args, optimizer, train_data, epoch, losses, key)
        test_losses.append(test(optimizer.params, test_data, args))
        scheduler.step()
    return {"losses": losses, "test_losses": test_losses, "params": optimizer.params}


if __name__ == "__main__":
    main()
