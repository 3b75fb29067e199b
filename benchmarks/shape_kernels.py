"""Kernels and compile time of a step over leaves of several shapes (not a test).

XLA's CPU compiler generates machine code once per distinct fused computation. Inside
``jit`` the rule is one nested call per parameter (``_base._staged_rule``), and XLA's
CSE merges what every call computes alike from the shared scalars (a scalar's broadcast
to the shape, its conversions) into the first call of each shape, whose fusions then
take their operands in another order: kernels of their own. This script compares the
package's rule with a variant that passes each call's scalars and its own parameter
through an ``optimization_barrier`` (so that no two calls' barriers are merged, and
every parameter of a shape fuses alike), which the performance guide reports as
measured and not adopted: fewer kernels, slower compile.

Prints, for the bench's whole training steps (``_bench_train``: forward + backward +
AdamW of the 200-leaf MLP and the 12-layer transformer) and optax's AdamW beside them,
the median XLA compile time of interleaved cold compiles (JAX's caches cleared before
each; x64 on unless ``--no-x64``) and the median of the paired differences; with
``--kernels``, the kernels each program compiles, counted from XLA's dump in a fresh
process per program.

Usage: ``python benchmarks/shape_kernels.py [--models mlp transformer] [--rounds 7] [--kernels] [--no-x64]``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

# torch's double scalars, as parity asks; FO_SHAPE_KERNELS_X64=0 (``--no-x64``): float32 ones
jax.config.update("jax_enable_x64", os.environ.get("FO_SHAPE_KERNELS_X64", "1") == "1")

import functorch_optim as fo  # noqa: E402
from functorch_optim import _base  # noqa: E402
from functorch_optim import _bench_train as T  # noqa: E402

VARIANTS = ("rule", "barrier", "optax")
PACKAGE_RULE = _base._staged_rule


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _barrier_rule(algorithm, static_key, const, flags, *args):
    param, grad, buffers, step, hp, one, active = args
    hp, param = jax.lax.optimization_barrier((hp, param))
    return _base._rule(algorithm, dict(static_key), const, flags, param, grad, buffers, step, hp, one, active)


def model(name: str):
    rng = np.random.default_rng(0)
    if name == "mlp":
        width, batch_size = T.FULL["mlp"]
        params = T.mlp_params(width, rng)
        x = jnp.asarray(rng.standard_normal((batch_size, width)), jnp.float32)
        return jax.tree.map(jnp.asarray, params), (x, x), T.mlp_loss
    d, heads, seq, batch_size, vocab = T.FULL["transformer"]
    params = T.transformer_params(d, vocab, seq + 1, rng)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch_size, seq + 1)), jnp.int32)
    return jax.tree.map(jnp.asarray, params), (tokens,), lambda p, t: T.transformer_loss(p, t, heads)


def lowered(name: str, variant: str):
    """The whole step of ``variant``, traced and lowered with JAX's caches cleared."""
    params, batch, loss = model(name)
    jax.clear_caches()
    if variant == "optax":
        tx, apply = optax.adamw(1e-3, weight_decay=0.01), T._optax_apply
    else:
        tx, apply = fo.adamw(1e-3, weight_decay=0.01, fused=False), T._fo_apply

    def step(p, s, *b):
        value, g = jax.value_and_grad(loss)(p, *b)
        p, s = apply(tx, p, g, s)
        return p, s, value

    step.__name__ = f"step_{variant}"
    _base._staged_rule = _barrier_rule if variant == "barrier" else PACKAGE_RULE
    try:
        return jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), *batch)
    finally:
        _base._staged_rule = PACKAGE_RULE


def compile_times(name: str, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds + 1):  # round 0: a discarded warm-up
        for variant in VARIANTS:
            program = lowered(name, variant)
            start = time.perf_counter()
            program.compile()
            if r:
                times[variant].append(time.perf_counter() - start)
    return times


def kernels(name: str, variant: str) -> int:
    """Kernels XLA compiles for ``variant``'s step: its dumped object files, one per
    distinct fused computation (the dump flag is read at start-up: a fresh process)."""
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}", "JAX_PLATFORMS": "cpu"}
        code = f"import runpy\nrunpy.run_path({__file__!r})['lowered']({name!r}, {variant!r}).compile()"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
        return sum(f".jit_step_{variant}.obj-file." in f for f in os.listdir(dump))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved cold compiles per variant")
    parser.add_argument("--kernels", action="store_true", help="also count each program's kernels")
    parser.add_argument("--no-x64", action="store_true", help="float32 hyperparameters (x64 off)")
    args = parser.parse_args()
    if args.no_x64:  # set before jax computes anything, and for the --kernels processes
        os.environ["FO_SHAPE_KERNELS_X64"] = "0"
        jax.config.update("jax_enable_x64", False)
    for name in args.models:
        times = compile_times(name, args.rounds)
        for variant, ts in times.items():
            count = f", {kernels(name, variant)} kernels" if args.kernels else ""
            print(f"{name} {variant}: XLA compile {statistics.median(ts):.2f} s (median of {len(ts)}){count}")
        diffs = [b - a for a, b in zip(times["rule"], times["barrier"], strict=True)]
        paired = [round(d, 2) for d in diffs]
        print(f"{name} barrier - rule, paired: median {statistics.median(diffs):+.2f} s {paired}")


if __name__ == "__main__":
    main()
