"""The demo: an MLP trained by SGD + momentum + grad_accumulate, beside torch's run."""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import functorch_optim as fo


def _data(seed: int, n: int):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, (n, 2))
    y = np.sin(x[:, :1]) * np.cos(x[:, 1:]) + 0.05 * rng.standard_normal((n, 1))
    return x, y


def _init(seed: int, hidden: int):
    rng = np.random.default_rng(seed)
    return {
        "fc1": {"weight": rng.standard_normal((hidden, 2)) / np.sqrt(2), "bias": np.zeros(hidden)},
        "fc2": {"weight": rng.standard_normal((1, hidden)) / np.sqrt(hidden), "bias": np.zeros(1)},
    }


def _loss(params, x, y):
    h = jnp.tanh(x @ params["fc1"]["weight"].T + params["fc1"]["bias"][None, :])
    pred = h @ params["fc2"]["weight"].T + params["fc2"]["bias"][None, :]
    return jnp.mean((pred - y) ** 2)


def run(steps: int = 60, every: int = 4, micro_batch: int = 16, hidden: int = 32, print_fn=print) -> dict:
    """Train the same MLP in JAX (functorch_optim) and torch; return both loss curves.

    Each optimizer step sees ``every`` micro-batches. In JAX, ``grad_accumulate`` sums
    them (mean reduction); in torch the loop divides each micro-batch loss by ``every``,
    calls ``backward()`` without ``zero_grad()`` and steps every ``every`` calls.
    """
    import torch

    jax.config.update("jax_enable_x64", True)
    x, y = _data(0, steps * every * micro_batch)
    init = _init(1, hidden)
    hp = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 1e-4, "nesterov": True}

    tx = fo.grad_accumulate(fo.sgd(**hp), every=every)
    params = jax.tree.map(jnp.asarray, init)
    state = tx.init(params)
    value_and_grad = jax.jit(jax.value_and_grad(_loss))
    step = jax.jit(functools.partial(fo.step, tx), donate_argnums=(0, 2))

    model = torch.nn.Sequential(
        torch.nn.Linear(2, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    ).double()
    with torch.no_grad():
        for layer, name in ((model[0], "fc1"), (model[2], "fc2")):
            layer.weight.copy_(torch.from_numpy(init[name]["weight"]))
            layer.bias.copy_(torch.from_numpy(init[name]["bias"]))
    opt = torch.optim.SGD(model.parameters(), foreach=False, **hp)

    jax_curve, torch_curve = [], []
    print_fn(f"{'step':>5} {'functorch_optim loss':>22} {'torch loss':>22} {'rel. diff':>10}")
    for t in range(steps):
        j_loss = t_loss = 0.0
        opt.zero_grad()
        for i in range(every):
            sl = slice((t * every + i) * micro_batch, (t * every + i + 1) * micro_batch)
            xb, yb = jnp.asarray(x[sl]), jnp.asarray(y[sl])
            loss, grads = value_and_grad(params, xb, yb)
            params, state = step(params, grads, state)
            j_loss += float(loss) / every
            tl = torch.nn.functional.mse_loss(model(torch.from_numpy(x[sl])), torch.from_numpy(y[sl])) / every
            tl.backward()  # no zero_grad(): gradients add up in .grad
            t_loss += float(tl.detach())
        opt.step()
        jax_curve.append(j_loss)
        torch_curve.append(t_loss)
        if t % max(1, steps // 12) == 0 or t == steps - 1:
            diff = abs(j_loss - t_loss) / abs(t_loss)
            print_fn(f"{t:>5} {j_loss:>22.15f} {t_loss:>22.15f} {diff:>10.1e}")
    max_diff = max(abs(a - b) / abs(b) for a, b in zip(jax_curve, torch_curve))
    print_fn(
        f"loss {jax_curve[0]:.4f} -> {jax_curve[-1]:.4f}; largest relative difference from torch over "
        f"{steps} steps: {max_diff:.1e}"
    )
    return {"jax": jax_curve, "torch": torch_curve, "max_rel_diff": max_diff}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``demo`` subcommand: exit status 0 when the two runs agree to 1e-9."""
    demo = subparsers.add_parser("demo", help="train an MLP with SGD + grad_accumulate next to torch")
    demo.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    demo.set_defaults(func=lambda args: 0 if run(steps=args.steps)["max_rel_diff"] <= 1e-9 else 1)
