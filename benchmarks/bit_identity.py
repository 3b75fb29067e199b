"""Before/after bit-identity check of every registered optimizer (the speed work).

A restructured step must give the same bits as before, in float32 and float64. Dump the
results of one checkout, change the code, dump again, compare::

    git archive HEAD functorch_optim | tar -x -C /tmp/before
    python benchmarks/bit_identity.py dump /tmp/before /tmp/before.pkl
    python benchmarks/bit_identity.py dump . /tmp/after.pkl
    python benchmarks/bit_identity.py compare /tmp/before.pkl /tmp/after.pkl

Each case (optimizer, grid configuration, dtype) runs four jitted, donated steps with a
``grad_mask`` that skips different leaves on different steps, one step with a ``None``
gradient, and one ``tx.update`` (the optax path), and keeps the params, the updates and
the whole state. ``--only sgd,adam`` and ``--stride k`` (every k-th grid configuration)
shorten a run; compare then checks the cases both files hold.
"""

from __future__ import annotations

import argparse
import pickle
import sys

import numpy as np

SHAPES = {"layer": {"w": (3, 4), "b": (4,)}, "scale": (), "v": (7,)}


def dump(root: str, out: str, only: list[str] | None, stride: int) -> None:
    sys.path.insert(0, root)
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    import functorch_optim as fo
    from functorch_optim._registry import OPTIMIZERS

    print("functorch_optim from", fo.__file__)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    results = {}
    for spec in OPTIMIZERS:
        if spec.closure or (only and spec.name not in only):
            continue
        for ci, config in enumerate(spec.grid):
            if ci % stride:
                continue
            for dt in (np.float32, np.float64):
                rng = np.random.default_rng(ci)
                shapes = spec.shapes or SHAPES
                params = jax.tree.map(
                    lambda s, dt=dt, rng=rng: jnp.asarray(rng.standard_normal(s).astype(dt)),
                    shapes,
                    is_leaf=is_shape,
                )
                tx = spec.factory(**config)
                state = tx.init(params)
                leaves, treedef = jax.tree.flatten(params)

                def grads(skip=None, dt=dt, rng=rng, leaves=leaves, treedef=treedef):
                    return treedef.unflatten(
                        [
                            None if i == skip else jnp.asarray(rng.standard_normal(np.shape(x)).astype(dt))
                            for i, x in enumerate(leaves)
                        ]
                    )

                step = jax.jit(
                    lambda p, g, s, m, tx=tx: fo.step(tx, p, g, s, grad_mask=m), donate_argnums=(0, 2)
                )
                for t in range(4):
                    mask = treedef.unflatten([jnp.asarray((t + i) % 3 != 0) for i in range(len(leaves))])
                    params, state = step(params, grads(), state, mask)
                params, state = jax.jit(lambda p, g, s, tx=tx: fo.step(tx, p, g, s))(params, grads(1), state)
                updates, state = jax.jit(tx.update)(grads(), state, params)
                key = f"{spec.name}/{ci}/{np.dtype(dt).name}"
                results[key] = [np.asarray(x) for x in jax.tree.leaves((params, updates, state))]
        print(spec.name, flush=True)
    with open(out, "wb") as f:
        pickle.dump(results, f)


def compare(a_path: str, b_path: str) -> int:
    with open(a_path, "rb") as f:
        a = pickle.load(f)
    with open(b_path, "rb") as f:
        b = pickle.load(f)
    keys = sorted(set(a) & set(b))
    differ = [
        k
        for k in keys
        if len(a[k]) != len(b[k])
        or any(x.dtype != y.dtype or x.tobytes() != y.tobytes() for x, y in zip(a[k], b[k], strict=True))
    ]
    print(f"{len(keys)} cases in both files; {len(differ)} differ: {differ[:20]}")
    return 1 if differ or not keys else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="run the grid with the package under ROOT, write OUT")
    d.add_argument("root")
    d.add_argument("out")
    d.add_argument("--only", help="comma-separated optimizer names")
    d.add_argument("--stride", type=int, default=1, help="every k-th grid configuration")
    c = sub.add_parser("compare", help="compare two dumps bit for bit")
    c.add_argument("a")
    c.add_argument("b")
    args = parser.parse_args()
    if args.cmd == "dump":
        dump(args.root, args.out, args.only.split(",") if args.only else None, args.stride)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
