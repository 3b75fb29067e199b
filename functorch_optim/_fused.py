"""``fused=True``: one-pass CPU kernels for SGD, Adam and AdamW through XLA's FFI.

XLA's CPU backend cannot fuse a step that writes two arrays into one loop, so a jitted
SGD step reads its inputs twice and Adam's more often (``ANCHORS.md``: ~65 % of the
memory bandwidth). ``fused=True`` replaces the per-parameter rule by a C++ kernel
(``_fused_kernels.cc``) that reads each input once and writes params and buffers in
place, on XLA's own thread pool, with the same operations in the same order, so results
are bit-identical to ``fused=False`` (tests/test_fused.py asserts it).

The kernel is compiled on first use with the system's C++ compiler (``$CXX``, else
``c++``/``g++``/``clang++``) against ``jax.ffi.include_dir()`` and cached in
``$FUNCTORCH_OPTIM_CACHE`` (default ``~/.cache/functorch_optim``), keyed by the source, the
jaxlib version and the compiler. On other backends (GPU, TPU), where XLA fuses the step
by itself, and for parameter dtypes other than float32/float64, the ordinary jitted rule
runs instead (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._base import Algorithm
from functorch_optim._torch_ops import caster, step_as_float

SOURCE = Path(__file__).with_name("_fused_kernels.cc")
_TARGETS = {"fo_sgd": "FoSgd", "fo_adam": "FoAdam"}
_FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError(
        "fused=True builds a small C++ kernel on first use and needs a C++ compiler; none was "
        "found (set CXX, or install g++ or clang++), or use fused=False"
    )


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "functorch_optim"
    return Path(os.environ.get("FUNCTORCH_OPTIM_CACHE", default))


@functools.cache
def load_kernels() -> str:
    """Build (once per source/jaxlib/compiler) and register the fused kernels.

    Returns:
      The path of the shared library.

    Raises:
      RuntimeError: no C++ compiler, or the build failed (the compiler's output is shown).
    """
    compiler = _compiler()
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        jax.lib.__version__.encode(),
        compiler.encode(),
        " ".join(_FLAGS).encode(),
    ):
        key.update(part)
    library = _cache_dir() / f"fused_kernels-{key.hexdigest()[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            built = Path(tmp) / library.name
            command = [compiler, *_FLAGS, "-w", "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"building the fused kernel failed:\n{' '.join(command)}\n{result.stderr}")
            os.replace(built, library)  # atomic: concurrent builders leave one whole file
    lib = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return str(library)


def _call(
    target: str,
    param: jax.Array,
    grad: jax.Array,
    buffers: list[jax.Array],
    scalars: list,
    flags: list,
    **attrs,
) -> tuple[jax.Array, list[jax.Array]]:
    dtype = param.dtype
    operands = [param, grad.astype(dtype), *buffers]
    out = jax.ffi.ffi_call(
        target,
        [jax.ShapeDtypeStruct(x.shape, dtype) for x in [param, *buffers]],
        input_output_aliases={0: 0, **{i + 2: i + 1 for i in range(len(buffers))}},
        vmap_method="sequential",
    )(
        *operands,
        jnp.stack([caster(dtype)(s).astype(dtype) for s in scalars]),
        jnp.stack([jnp.asarray(f, jnp.int32) for f in flags]),
        **{k: bool(v) for k, v in attrs.items()},
    )
    return out[0], list(out[1:])


def fused_algorithm(algorithm: Algorithm, kernel: Callable[..., Any]) -> Algorithm:
    """``algorithm`` with ``kernel`` as its ``fused_step_leaf``. Builds the kernel library
    now, so that a missing compiler is reported at construction, before any state exists.
    (torch's "floating point params only" check for ``fused`` is every optimizer's here.)"""
    load_kernels()
    return dataclasses.replace(algorithm, fused_step_leaf=_fused_rule(kernel, algorithm.step_leaf))


def _explicitly_sharded(x: jax.Array) -> bool:
    # under an explicit-sharding mesh each device holds a slice: the per-device kernel
    # has no partitioning rule, so the jitted rule (which XLA partitions) runs instead
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


def _fused_rule(
    kernel: Callable[..., tuple[jax.Array, dict[str, jax.Array]]],
    rule: Callable[..., tuple[jax.Array, dict[str, jax.Array]]],
) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    # ``kernel`` on CPU for float32/float64 parameters; elsewhere ``rule`` (the jitted
    # per-parameter rule) and then the mask, as the engine would apply it

    def masked_rule(param, grad, buffers, step, hp, static, active):
        new_param, new = rule(param, grad, buffers, step, hp, static)
        if active is None:
            return new_param, new
        return jnp.where(active, new_param, param), {n: jnp.where(active, new[n], buffers[n]) for n in new}

    def step_leaf(param, grad, buffers, step, hp, static, active):
        if param.dtype not in _KERNEL_DTYPES or _explicitly_sharded(param):
            return masked_rule(param, grad, buffers, step, hp, static, active)
        active = jnp.asarray(True if active is None else active)
        return jax.lax.platform_dependent(
            param,
            grad,
            buffers,
            step,
            hp,
            active,
            cpu=lambda *a: kernel(*a[:5], static, a[5]),
            default=lambda *a: masked_rule(*a[:5], static, a[5]),
        )

    return step_leaf


def sgd_kernel(
    param: jax.Array,
    grad: jax.Array,
    buffers: Mapping[str, jax.Array],
    step: jax.Array,
    hp: Mapping[str, Any],
    static: Mapping[str, Any],
    active: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SGD's rule (``_sgd._step_leaf``) as one kernel call; same scalars, same rounding."""
    names = ["momentum_buffer"] if static["has_momentum"] else []
    scalars = [-hp["lr"], hp["momentum"], 1 - hp["dampening"], hp["weight_decay"]]
    flags = [active, hp["weight_decay"] != 0, step == 1, hp["momentum"] != 0]
    new_param, new = _call(
        "fo_sgd",
        param,
        grad,
        [buffers[n] for n in names],
        scalars,
        flags,
        has_momentum=static["has_momentum"],
        nesterov=static["nesterov"],
        maximize=static["maximize"],
    )
    return new_param, dict(zip(names, new))


def adam_kernel(
    param: jax.Array,
    grad: jax.Array,
    buffers: Mapping[str, jax.Array],
    step: jax.Array,
    hp: Mapping[str, Any],
    static: Mapping[str, Any],
    active: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Adam's and AdamW's rule (``_adam._step_leaf``) as one kernel call."""
    c = caster(param.dtype)
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if static["amsgrad"] else [])
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    t = step_as_float(step, hp)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    weight = c(1 - beta1)
    scalars = [
        1 - lr * wd,
        wd,
        weight,
        1 - weight,
        beta2,
        1 - beta2,
        1 / c(jnp.sqrt(bias_correction2)),
        eps,
        -(lr / bias_correction1),
    ]
    flags = [active, wd != 0, jnp.abs(weight) < 0.5]
    new_param, new = _call(
        "fo_adam",
        param,
        grad,
        [buffers[n] for n in names],
        scalars,
        flags,
        maximize=static["maximize"],
        decoupled=static["decoupled_weight_decay"],
        amsgrad=static["amsgrad"],
    )
    return new_param, dict(zip(names, new))
