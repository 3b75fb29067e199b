"""One phase of a torch training run resumed across torch and JAX, run in a fresh process.

tests/test_checkpoint.py runs ``python -m tests._checkpoint_phases PHASE IN OUT START STOP
[PHASE IN OUT START STOP ...]``, phases reading checkpoints of earlier processes only. Each
phase loads the whole checkpoint ``IN`` (``torch.load`` with its default
``weights_only=True``; none for the first phase), trains steps ``START..STOP-1`` and
writes the checkpoint ``OUT`` with ``torch.save`` plus ``OUT.json`` (the loss of each step,
and the final parameters by name). Phases:

* ``torch``: ``torch.optim.Adam`` + ``OneCycleLR`` (cycles beta1) + ``torch.amp.GradScaler``;
* ``facade``: the same names from ``functorch_optim.optim`` and ``fo.GradScaler``;
* ``functional``: ``fo.adam`` + ``fo.step`` (jitted) on the state the checkpoint holds,
  its lr and betas set each step (``fo.set_hparams``) by the scheduler class.

The model is a float64 MLP (``Linear(4, 8)``, ``Tanh``, ``Linear(8, 3)``), MSE loss, one
fixed batch per step (two with an inf target). Nothing runs on import (pytest imports
this module for doctests).
"""

from __future__ import annotations

import json
import sys

LR, MAX_LR, TOTAL = 1e-3, 0.05, 40
SCALER = dict(init_scale=2.0**8, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)


INF_AT = (13, 23)  # an inf target there: GradScaler skips the step and backs off


def batch(t):
    """The batch of step ``t`` (float64 numpy), identical in every process."""
    import numpy as np

    rng = np.random.default_rng(1000 + t)
    x = rng.standard_normal((16, 4))
    y = np.tanh(x @ np.arange(12.0).reshape(4, 3) / 10)
    if t in INF_AT:
        y[0, 0] = np.inf
    return x, y


def torch_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def torch_phase(ckpt_in, start, stop):
    import torch

    model = torch_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, MAX_LR, total_steps=TOTAL)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    epoch = 0
    if ckpt_in:
        ckpt = torch.load(ckpt_in)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        epoch = ckpt["epoch"]
    losses = []
    for t in range(start, stop):
        x, y = (torch.tensor(a) for a in batch(t))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
        epoch += 1
    ckpt = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
    }
    params = {n: p.detach().numpy().tolist() for n, p in model.named_parameters()}
    return ckpt, losses, params


def mse(params, x, y):
    import jax.numpy as jnp

    h = jnp.tanh(x @ params["0.weight"].T + params["0.bias"])
    return jnp.mean((h @ params["2.weight"].T + params["2.bias"] - y) ** 2)


def jax_phase(kind, ckpt_in, start, stop):
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import torch

    import functorch_optim as fo
    from functorch_optim.interop.torch import flatten_names, tree_from_state_dict, tree_to_state_dict
    from functorch_optim.optim import Adam
    from functorch_optim.optim.lr_scheduler import OneCycleLR

    ckpt = torch.load(ckpt_in)  # weights_only=True: torch's safe default
    params = tree_from_state_dict(ckpt["model"])  # flattens in named_parameters() order: torch's ids
    opt = Adam(params, lr=LR)
    sched = OneCycleLR(opt, MAX_LR, total_steps=TOTAL)
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    scaler = fo.GradScaler(**SCALER)
    sstate = scaler.load_state_dict(ckpt["scaler"])
    epoch = ckpt["epoch"]

    def scaled_loss(p, x, y, sc):
        loss = mse(flatten_names(p), x, y)
        return scaler.scale(sc, loss), loss

    grad_fn = jax.jit(jax.grad(scaled_loss, has_aux=True))
    losses = []
    if kind == "facade":
        for t in range(start, stop):
            x, y = batch(t)
            grads, loss = grad_fn(opt.params, jnp.asarray(x), jnp.asarray(y), sstate)
            grads, sstate = scaler.unscale(sstate, grads)  # scaler.step(opt): unscale, skip on inf
            if float(sstate.found_inf) == 0:
                opt.grad = grads
                opt.step()
            sstate = scaler.update(sstate)
            sched.step()
            losses.append(float(loss))
            epoch += 1
        params = opt.params
    else:  # the functional state the checkpoint holds, stepped by fo.step
        tx = fo.adam(lr=LR)
        params, state = opt.params, opt.state
        step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
        for t in range(start, stop):
            x, y = batch(t)
            grads, loss = grad_fn(params, jnp.asarray(x), jnp.asarray(y), sstate)
            grads, sstate = scaler.unscale(sstate, grads)
            if float(sstate.found_inf) == 0:
                params, state = step(params, grads, state)
            sstate = scaler.update(sstate)
            sched.step()  # the class on the facade's groups: the lr and beta1 of the next step
            group = opt.param_groups[0]
            state = fo.set_hparams(state, lr=group["lr"], betas=tuple(group["betas"]))
            losses.append(float(loss))
            epoch += 1
        opt.params, opt.state = params, state
    ckpt = {
        "model": tree_to_state_dict(params),
        "optimizer": opt.state_dict(),  # torch tensors already
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(sstate),
        "epoch": epoch,
    }
    return ckpt, losses, {n: np.asarray(v).tolist() for n, v in flatten_names(params).items()}


def main(argv):
    import torch

    for i in range(0, len(argv), 5):
        kind, ckpt_in, ckpt_out, start, stop = (
            argv[i],
            argv[i + 1],
            argv[i + 2],
            int(argv[i + 3]),
            int(argv[i + 4]),
        )
        if kind == "torch":
            ckpt, losses, params = torch_phase(ckpt_in if ckpt_in != "-" else None, start, stop)
        else:
            ckpt, losses, params = jax_phase(kind, ckpt_in, start, stop)
        torch.save(ckpt, ckpt_out)
        with open(ckpt_out + ".json", "w") as f:
            json.dump({"losses": losses, "params": params}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
