"""What the imperative facade costs on top of the jitted functional step (not a test).

Prints medians of per-step wall time:

1. ``SGD(...).step()`` of ``functorch_optim.optim`` vs the jitted, donated functional
   step ``jax.jit(fo.step, static_argnums=0, donate_argnums=(1, 3))`` at 10M float32
   parameters (target: facade ≤ 1.1× functional);
2. the same two at 100 leaves × 1k (per-call overhead dominates), next to torch's
   ``torch.optim.SGD`` step (for-loop and foreach).

Usage: ``python benchmarks/facade_overhead.py [--big 10000000] [--leaves 100] [--leaf 1000]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import functorch_optim as fo
from functorch_optim.optim import SGD

CONFIG = {"lr": 0.01, "momentum": 0.9}


def compare(fns: dict, rounds: int, per_round: int) -> dict[str, tuple[float, float]]:
    """Interleaved timing: ``rounds`` × (``per_round`` calls of each fn); (median, min) seconds.

    Interleaving shares out a busy machine's slow phases evenly; the minimum is the
    least disturbed call.
    """
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def make_tree(n_leaves: int, leaf_size: int, seed: int) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), n_leaves)
    return {f"p{i:03d}": jax.random.normal(k, (leaf_size,), jnp.float32) for i, k in enumerate(keys)}


def functional_step(params, grads):
    tx = fo.sgd(**CONFIG)
    step = jax.jit(fo.step, static_argnums=0, donate_argnums=(1, 3))
    box = {"p": jax.tree.map(jnp.copy, params), "s": tx.init(params)}

    def one():
        box["p"], box["s"] = step(tx, box["p"], grads, box["s"])
        jax.block_until_ready(box["p"])

    return one


def facade_step(params, grads):
    opt = SGD(params, **CONFIG)
    opt.grad = grads

    def one():
        opt.step()
        jax.block_until_ready(opt.param_groups[0]["params"])

    return one


def torch_step(params, grads, foreach: bool):
    import torch

    ts = [torch.tensor(np.asarray(p)).requires_grad_(True) for p in jax.tree.leaves(params)]
    for t, g in zip(ts, jax.tree.leaves(grads), strict=True):
        t.grad = torch.tensor(np.asarray(g))
    opt = torch.optim.SGD(ts, foreach=foreach, **CONFIG)
    return opt.step


def report(title: str, results: dict[str, tuple[float, float]], unit: float, label: str) -> None:
    print(title)
    base = results["functional jitted step"]
    for name, (med, low) in results.items():
        ratio = (
            "" if name.startswith("torch") else f"   ratio {med / base[0]:.3f}x (min {low / base[1]:.3f}x)"
        )
        print(f"  {name:24s} median {med * unit:9.1f} {label}  min {low * unit:9.1f} {label}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", type=int, default=10_000_000, help="parameters in the large case")
    parser.add_argument("--big-leaves", type=int, default=10, help="leaves in the large case")
    parser.add_argument("--leaves", type=int, default=100, help="leaves in the small case")
    parser.add_argument("--leaf", type=int, default=1000, help="elements per leaf in the small case")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; SGD {CONFIG}, float32\n")

    params = make_tree(args.big_leaves, args.big // args.big_leaves, 0)
    grads = make_tree(args.big_leaves, args.big // args.big_leaves, 1)
    fns = {
        "functional jitted step": functional_step(params, grads),
        "facade opt.step()": facade_step(params, grads),
    }
    results = compare(fns, args.rounds, 5)
    report(f"{args.big:,} params in {args.big_leaves} leaves (target: facade <= 1.1x):", results, 1e3, "ms")
    del params, grads, fns

    params = make_tree(args.leaves, args.leaf, 2)
    grads = make_tree(args.leaves, args.leaf, 3)
    fns = {
        "functional jitted step": functional_step(params, grads),
        "facade opt.step()": facade_step(params, grads),
    }
    try:
        fns["torch SGD for-loop"] = torch_step(params, grads, foreach=False)
        fns["torch SGD foreach"] = torch_step(params, grads, foreach=True)
    except ImportError:
        print("(torch not installed: no torch rows)")
    results = compare(fns, args.rounds, 50)
    report(f"\n{args.leaves} leaves x {args.leaf} elements:", results, 1e6, "us")


if __name__ == "__main__":
    main()
