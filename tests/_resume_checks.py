"""Resuming a facade run in a fresh process, from a checkpoint taken right after
``scheduler.step()``; run by tests/test_optim_state_dict.py as
``python -m tests._resume_checks DIR``.

The training problem, the checkpoint writer and the restorer live here so that the test
(the writer and the uninterrupted run) and the fresh process (the restorer) share them.
Each restore path builds a fresh optimizer and scheduler, as a resumed script does
(torch's order: the scheduler before the optimizer's state), restores, continues and
writes its parameters, state and learning rates to ``DIR/<path>.npz``.
"""

from __future__ import annotations

import os
import pickle
import sys

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim.optim import Adam
from functorch_optim.optim.lr_scheduler import LinearLR

STEPS, SPLIT = 8, 4
#: the checkpoint paths: torch.save of state_dict(), pickle and orbax of ``opt.state``
PATHS = ("state_dict", "pickle", "orbax")


def build():
    """A fresh optimizer and scheduler; LinearLR moves the lr on every step (and at
    construction), so a checkpoint after ``scheduler.step()`` has a pending lr."""
    rng = np.random.default_rng(0)
    params = {
        "enc": {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)},
        "scale": np.float64(1.5),
    }
    opt = Adam(params, lr=0.05, betas=(0.8, 0.99))
    return opt, LinearLR(opt, start_factor=0.25, total_iters=6)


def train(opt, scheduler, steps):
    for t in steps:
        rng = np.random.default_rng(100 + t)
        opt.grad = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(np.shape(p))), opt.params)
        opt.step()
        scheduler.step()


def checkpoint(opt, scheduler, directory):
    """Every path's checkpoint of ``opt`` (and the scheduler's state, pickled)."""
    import orbax.checkpoint as ocp
    import torch

    with open(os.path.join(directory, "scheduler.pkl"), "wb") as f:
        pickle.dump(scheduler.state_dict(), f)
    with open(os.path.join(directory, "params.pkl"), "wb") as f:
        pickle.dump(jax.device_get(opt.params), f)
    torch.save(opt.state_dict(), os.path.join(directory, "optimizer.pt"))
    with open(os.path.join(directory, "state.pkl"), "wb") as f:
        pickle.dump(opt.state, f)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, "state.orbax"), opt.state)
    checkpointer.wait_until_finished()


def restore(path, directory):
    """A fresh optimizer and scheduler resumed from the ``path`` checkpoint."""
    import orbax.checkpoint as ocp
    import torch

    opt, scheduler = build()
    with open(os.path.join(directory, "params.pkl"), "rb") as f:
        opt.params = pickle.load(f)
    if path == "state_dict":
        opt.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt")))
    elif path == "pickle":
        with open(os.path.join(directory, "state.pkl"), "rb") as f:
            opt.state = pickle.load(f)
    else:
        target = jax.eval_shape(lambda: opt.state)
        opt.state = ocp.StandardCheckpointer().restore(os.path.join(directory, "state.orbax"), target)
    with open(os.path.join(directory, "scheduler.pkl"), "rb") as f:
        scheduler.load_state_dict(pickle.load(f))
    return opt, scheduler


def summary(opt, scheduler):
    """Everything the comparison looks at, as host arrays."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(opt.params)]
    leaves += [np.asarray(x) for x in jax.tree.leaves(opt.state)]
    return {
        **{f"leaf{i}": x for i, x in enumerate(leaves)},
        "lr": np.asarray(opt.param_groups[0]["lr"]),
        "last_lr": np.asarray(scheduler.get_last_lr()),
    }


def main(directory):
    jax.config.update("jax_enable_x64", True)
    for path in PATHS:
        opt, scheduler = restore(path, directory)
        train(opt, scheduler, range(SPLIT, STEPS))
        np.savez(os.path.join(directory, f"{path}.npz"), **summary(opt, scheduler))
    print("RESUMED", *PATHS)


if __name__ == "__main__":
    main(sys.argv[1])
