"""The JAX port of ``time_sequence_prediction_torch.py``: facade LBFGS with torch's closure.

Line for line: ``optim.LBFGS(seq.parameters(), lr=0.8)`` ->
``functorch_optim.optim.LBFGS(params, lr=0.8)``; the closure keeps torch's shape
(``zero_grad()``, a forward pass that returns the loss, ``backward``), with
``optimizer.backward(loss_fn, ...)`` standing for ``loss = criterion(...);
loss.backward()``; ``optimizer.step(closure)`` calls it as torch's line search does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxnn as F
import synthetic
import time_sequence_prediction_torch as ref

from functorch_optim.interop.torch import tree_from_module
from functorch_optim.optim import LBFGS


def seq(p, input, future=0):
    """``Sequence.forward``; the loops over time are ``lax.scan`` (one compiled cell each)."""
    n, hidden = input.shape[0], p["linear"]["weight"].shape[1]
    zeros = jnp.zeros((n, hidden), jnp.float64)

    def cell(carry, input_t):
        h_t, c_t, h_t2, c_t2 = carry
        h_t, c_t = F.lstm_cell(p["lstm1"], input_t, h_t, c_t)
        h_t2, c_t2 = F.lstm_cell(p["lstm2"], h_t, h_t2, c_t2)
        output = F.linear(p["linear"], h_t2)
        return (h_t, c_t, h_t2, c_t2), output

    carry, outputs = jax.lax.scan(cell, (zeros, zeros, zeros, zeros), input.T[:, :, None])
    outputs = [outputs[:, :, 0].T]
    if future:  # if we should predict the future

        def free(state, _):
            carry, output = state
            carry, output = cell(carry, output)
            return (carry, output), output

        _, more = jax.lax.scan(free, (carry, outputs[0][:, -1:]), None, length=future)
        outputs.append(more[:, :, 0].T)
    return jnp.concatenate(outputs, axis=1)


def criterion(out, target):
    return jnp.mean((out - target) ** 2)


def loss_fn(params, input, target):
    return criterion(seq(params, input), target)


def main(argv=None):
    opt = ref.parse(argv)
    jax.config.update("jax_enable_x64", True)
    params = tree_from_module(ref.model(opt))  # the torch model's initial weights
    data = synthetic.sine_waves(opt.waves, opt.length)
    input, target = data[3:, :-1], data[3:, 1:]
    test_input, test_target = data[:3, :-1], data[:3, 1:]
    optimizer = LBFGS(params, lr=0.8)
    predict = jax.jit(seq, static_argnames="future")
    losses, test_losses = [], []
    for i in range(opt.steps):
        print("STEP: ", i)

        def closure():
            optimizer.zero_grad()
            loss = optimizer.backward(loss_fn, input, target)
            print("loss:", float(loss))
            losses.append(float(loss))
            return loss

        optimizer.step(closure)
        # begin to predict
        future = opt.future
        pred = predict(optimizer.params, test_input, future=future)
        loss = criterion(pred[:, :-future], test_target)
        print("test loss:", float(loss))
        test_losses.append(float(loss))
    return {"losses": losses, "test_losses": test_losses, "params": optimizer.params}


if __name__ == "__main__":
    main()
