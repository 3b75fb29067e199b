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

It also compiles the rule without each of the measures that keep its numbers torch's
(``--variants``; measurements, never the package's program: their numbers are not
torch's): ``unstored``, ``stored`` the identity (XLA's CPU code generator may then fuse
a product into the add that follows it, one rounding where torch rounds twice);
``plain-divide``, ``sqrt(v) / sqrt(bias_correction2)`` as a plain division (which XLA
turns into a multiplication by the reciprocal); ``plain-lerp``, ``exp_avg``'s lerp as
``start + weight * (end - start)`` (no FMA, no branch on the weight); and
``unguarded``, all three.

Prints, for the bench's whole training steps (``_bench_train``: forward + backward +
AdamW of the 200-leaf MLP and the 12-layer transformer) and optax's AdamW beside them,
the median XLA compile time of interleaved cold compiles (JAX's caches cleared before
each; x64 on unless ``--no-x64``) and the median of each variant's paired differences
from the rule and from optax; with ``--kernels``, the kernels each program compiles,
counted from XLA's dump in a fresh process per program.

Usage: ``python benchmarks/shape_kernels.py [--models mlp transformer] [--variants rule barrier optax]
[--rounds 7] [--kernels] [--no-x64]``
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
from functorch_optim import _adam, _base, _torch_ops  # noqa: E402
from functorch_optim import _bench_train as T  # noqa: E402

PACKAGE_RULE = _base._staged_rule


def _plain_lerp(start, end, weight):
    return start + jnp.asarray(weight, start.dtype) * (end - start)


def _plain_divide(x, divisor):
    return x / jnp.asarray(divisor).astype(x.dtype)


#: per variant, the module attributes it replaces while its step is traced (AdamW's rule
#: reads ``lerp_fma`` and ``true_divide`` from ``_adam``; ``fma`` and ``rounded_product``
#: read ``stored`` from ``_torch_ops``)
GUARDS = {
    "unstored": {(_torch_ops, "stored"): lambda x: x},
    "plain-divide": {(_adam, "true_divide"): _plain_divide},
    "plain-lerp": {(_adam, "lerp_fma"): _plain_lerp},
}
GUARDS["unguarded"] = {k: v for patch in GUARDS.values() for k, v in patch.items()}
VARIANTS = ("rule", "barrier", *GUARDS, "optax")


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

    step.__name__ = f"step_{variant.replace('-', '_')}"
    patches = {(_base, "_staged_rule"): _barrier_rule} if variant == "barrier" else GUARDS.get(variant, {})
    saved = {key: getattr(*key) for key in patches}
    try:
        for (module, attr), value in patches.items():
            setattr(module, attr, value)
        return jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), *batch)
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)
        if patches:  # no trace made with a patch outlives it (the nested jits cache theirs)
            jax.clear_caches()


def compile_times(name: str, rounds: int, variants: list[str]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds + 1):  # round 0: a discarded warm-up
        for variant in variants:
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
        return sum(f".jit_step_{variant.replace('-', '_')}.obj-file." in f for f in os.listdir(dump))


def _paired(times: dict[str, list[float]], variant: str, against: str) -> str:
    diffs = [b - a for a, b in zip(times[against], times[variant], strict=True)]
    each = [round(d, 2) for d in diffs]
    return f"{variant} - {against}, paired: median {statistics.median(diffs):+.2f} s {each}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved cold compiles per variant")
    parser.add_argument("--kernels", action="store_true", help="also count each program's kernels")
    parser.add_argument("--no-x64", action="store_true", help="float32 hyperparameters (x64 off)")
    args = parser.parse_args()
    if args.no_x64:  # set before jax computes anything, and for the --kernels processes
        os.environ["FO_SHAPE_KERNELS_X64"] = "0"
        jax.config.update("jax_enable_x64", False)
    variants = list(dict.fromkeys(args.variants))
    for name in args.models:
        times = compile_times(name, args.rounds, variants)
        for variant, ts in times.items():
            count = f", {kernels(name, variant)} kernels" if args.kernels else ""
            print(f"{name} {variant}: XLA compile {statistics.median(ts):.2f} s (median of {len(ts)}){count}")
        for against in ("rule", "optax"):
            for variant in variants:
                if against in times and variant not in ("rule", against):
                    print(f"{name} {_paired(times, variant, against)}")


if __name__ == "__main__":
    main()
