"""``fused=True``: one-pass CPU kernels for SGD, Adam, AdamW and Adagrad through XLA's FFI.

XLA's CPU backend cannot fuse a step that writes two arrays into one loop, so a jitted
SGD step reads its inputs twice and Adam's more often (``ANCHORS.md``: ~65 % of the
memory bandwidth). ``fused=True`` replaces the per-parameter rule by a C++ kernel
(``_fused_kernels.cc``) that reads each input once and writes params and buffers in
place, on XLA's own thread pool, with the same operations in the same order, so results
are bit-identical to ``fused=False`` (tests/test_fused.py asserts it).

The kernel is compiled on first use with the system's C++ compiler (``$CXX``, else
``c++``/``g++``/``clang++``) against ``jax.ffi.include_dir()`` and cached in
``$FUNCTORCH_OPTIM_CACHE`` (default ``~/.cache/functorch_optim``), keyed by the source,
the jaxlib version, the compiler and its flags (``library_path``). On other backends (GPU,
TPU), where XLA fuses the step by itself, and for parameter dtypes other than
float32/float64, the ordinary jitted rule runs instead (``jax.lax.platform_dependent``).
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._base import Algorithm, rule_step
from functorch_optim._torch_ops import caster, step_as_float

SOURCE = Path(__file__).with_name("_fused_kernels.cc")
_TARGETS = {"fo_sgd": "FoSgd", "fo_adam": "FoAdam", "fo_adagrad": "FoAdagrad"}
_FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# Parameters per kernel call: XLA's compile time grows faster than linearly in the
# operands of one call (1000 leaves in one call: 39 s; in calls of 128: 3.7 s).
_LEAVES_PER_CALL = 128


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


def library_path(compiler: str, flags: tuple[str, ...]) -> Path:
    """Where the kernel library built by ``compiler`` with ``flags`` is cached: under
    ``$FUNCTORCH_OPTIM_CACHE``, named by a hash of the source, jaxlib's version, the
    compiler and the flags (a change of any rebuilds)."""
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        jax.lib.__version__.encode(),
        compiler.encode(),
        " ".join(flags).encode(),
    ):
        key.update(part)
    return _cache_dir() / f"fused_kernels-{key.hexdigest()[:16]}.so"


@functools.cache
def load_kernels() -> str:
    """Build (once per source/jaxlib/compiler) and register the fused kernels.

    Returns:
      The path of the shared library.

    Raises:
      RuntimeError: no C++ compiler, or the build failed (the compiler's output is shown).
    """
    compiler = _compiler()
    library = library_path(compiler, _FLAGS)
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


Leaf = tuple[jax.Array, jax.Array, dict[str, jax.Array], jax.Array, Any]
"""One parameter's ``(param, grad, buffers, step, active)``: ``buffers`` without the step
counter, ``step`` the counter before this step, ``active`` its ``grad_mask`` flag or
``None``."""


class Window(NamedTuple):
    """``grad_accumulate``'s share of a kernel call (``fused_window``): the call adds the
    gradient into the accumulator, or, on the call that closes the window, steps on the
    window's mean (sum, weighted mean) and writes it to the accumulator, in the same pass.

    Attributes:
      accs: the accumulator: a tree like the params (``grad_accumulate``), a list over
        the parameters of the call (the kernels; the parameter's dtype).
      fresh: whether this call opens a window (it overwrites the sum), a bool scalar.
      stepping: whether it closes one (the optimizer steps), a bool scalar; never
        together with ``fresh`` (a window has at least two calls).
      divisor: what the closing call divides the sum by (``window_scale``): ``None``
        for the sum; a Python int, the window's length (``reduction="mean"``); or an
        array over the same parameters as ``accs`` (the weight sums, or a flushed
        window's length).
      present: whether each parameter has a gradient in this call (``grad_mask``
        applied), a bool vector over the same parameters as ``accs``; ``None``: those
        whose gradient is not ``None``.
      weight: ``reduction="weighted"``: this call's weight, a scalar; the gradient goes
        in as ``acc + g * weight``. ``None`` otherwise.
    """

    accs: Any
    fresh: jax.Array
    stepping: jax.Array
    divisor: Any
    present: jax.Array | None = None
    weight: jax.Array | None = None


def window_scale(divisor: Any, dtype: Any) -> Any:
    """What a window's closing call multiplies its sum by, in ``dtype``: 1 (``divisor``
    None); ``1 / every`` for a Python int, as XLA computes ``sum / every`` (times the
    reciprocal); for an array, ``1 / divisor`` where it is positive and 0 elsewhere (a
    parameter whose window weighs nothing: it does not step)."""
    if divisor is None:
        return np.asarray(1, dtype)
    if isinstance(divisor, int):
        return np.reciprocal(np.asarray(divisor, dtype))
    d = jnp.asarray(divisor).astype(dtype)
    return jnp.where(d > 0, 1 / jnp.where(d > 0, d, 1), jnp.zeros((), dtype))


def _call(
    target: str,
    leaves: list[Leaf],
    names: list[str],
    scalars: list,
    flags: list,
    window: Window | None = None,
    **attrs: bool,
) -> list[tuple[jax.Array, ...]]:
    """One kernel call for ``leaves`` (one dtype); it also advances their step counters.
    ``scalars`` / ``flags``: per-parameter values, each a scalar (the same for all) or a
    vector over the leaves. Per leaf ``(param, buffers)``, with a ``window`` ``(param,
    buffers, accumulator)``."""
    dtype = leaves[0][0].dtype
    count = len(leaves)
    params = [leaf[0] for leaf in leaves]
    buffers = [leaf[2][n] for n in names for leaf in leaves]
    steps = [leaf[3] for leaf in leaves]
    if window is None:
        grads = [leaf[1].astype(dtype) for leaf in leaves]
    else:
        # a parameter without a gradient in this call gets a one-element stand-in
        grads = [jnp.zeros((1,), dtype) if leaf[1] is None else leaf[1].astype(dtype) for leaf in leaves]
        has_grad = window.present
        if has_grad is None:
            has_grad = np.asarray([leaf[1] is not None for leaf in leaves])
        buffers += window.accs
        weight = 1 if window.weight is None else window.weight
        scalars = [*scalars, window_scale(window.divisor, dtype), weight]
        flags = [*flags, has_grad, window.fresh, window.stepping, window.weight is not None]
    c = caster(dtype)
    scalars = jnp.stack([jnp.broadcast_to(c(x).astype(dtype), (count,)) for x in scalars], axis=1)
    flags = jnp.stack([jnp.broadcast_to(jnp.asarray(x, jnp.int32), (count,)) for x in flags], axis=1)
    outputs = [*params, *buffers, *steps]
    out = jax.ffi.ffi_call(
        target,
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs],
        # params -> outputs 0..L-1, then buffers and step counters (the grads sit between)
        input_output_aliases={
            **{i: i for i in range(count)},
            **{2 * count + j: count + j for j in range(len(buffers) + count)},
        },
        vmap_method="sequential",
    )(
        *params,
        *grads,
        *buffers,
        *steps,
        scalars,
        flags,
        count=np.int64(count),
        window=window is not None,
        **attrs,
    )
    n = len(names) + (window is not None)
    return [
        (
            out[i],
            {
                "step": out[(1 + n) * count + i],
                **{m: out[count + k * count + i] for k, m in enumerate(names)},
            },
            *([] if window is None else [out[count + len(names) * count + i]]),
        )
        for i in range(count)
    ]


def fused_algorithm(algorithm: Algorithm, kernel: Callable[..., Any]) -> Algorithm:
    """``algorithm`` with ``kernel`` as its ``fused_step``. Builds the kernel library now,
    so that a missing compiler is reported at construction, before any state exists.
    (torch's "floating point params only" check for ``fused`` is every optimizer's here.)"""
    load_kernels()
    return dataclasses.replace(
        algorithm, fused_step=_fused_step(kernel, algorithm), fused_window=_fused_window(kernel)
    )


def _explicitly_sharded(x: jax.Array) -> bool:
    # under an explicit-sharding mesh each device holds a slice: the per-device kernel
    # has no partitioning rule, so the jitted rule (which XLA partitions) runs instead
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


def kernel_leaf(param: jax.Array) -> bool:
    """Whether the kernel updates ``param`` (on the CPU): a non-empty float32/float64
    array that no explicit-sharding mesh splits."""
    return param.dtype in _KERNEL_DTYPES and param.size > 0 and not _explicitly_sharded(param)


def _batches(leaves: list[Leaf]) -> list[list[int]]:
    """The kernel leaves' indices, one list per call: by dtype, at most
    ``_LEAVES_PER_CALL`` each."""
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if kernel_leaf(leaf[0]):
            groups.setdefault(leaf[0].dtype, []).append(i)
    return [v[k : k + _LEAVES_PER_CALL] for v in groups.values() for k in range(0, len(v), _LEAVES_PER_CALL)]


def _fused_step(
    kernel: Callable[..., list[tuple[jax.Array, dict[str, jax.Array]]]], algorithm: Algorithm
) -> Callable[..., list[tuple[jax.Array, dict[str, jax.Array]]]]:
    # ``kernel``: one call per dtype on CPU for the float32/float64 parameters; elsewhere,
    # and for every other parameter, the jitted per-parameter rule and the mask

    def fused_step(
        leaves: list[Leaf], hparams_of, static, one: jax.Array
    ) -> list[tuple[jax.Array, dict[str, jax.Array]]]:
        out: list[Any] = [None] * len(leaves)
        for i, leaf in enumerate(leaves):
            if not kernel_leaf(leaf[0]):
                out[i] = rule_step(algorithm, leaf, hparams_of, static, one)
        for indices in _batches(leaves):
            group = [
                (*leaves[i][:4], jnp.asarray(True if leaves[i][4] is None else leaves[i][4])) for i in indices
            ]
            hp = hparams_of(group[0][0].dtype)
            results = jax.lax.platform_dependent(
                group,
                hp,
                one,
                cpu=lambda g, h, one: kernel(g, h, static, one),
                default=lambda g, h, one: [
                    rule_step(algorithm, leaf, lambda _: h, static, one) for leaf in g
                ],
            )
            for i, result in zip(indices, results):
                out[i] = result
        return out

    return fused_step


def _fused_window(kernel: Callable[..., list]) -> Callable[..., list]:
    def fused_window(
        leaves: list[Leaf], window: Window, hparams_of, static, one: jax.Array
    ) -> list[tuple[jax.Array, dict[str, jax.Array], jax.Array]]:
        # every non-empty parameter is a kernel leaf (``window_ready``); an empty one
        # has nothing to update but its step counter
        out: list[Any] = [None] * len(leaves)
        for i, (param, _, buffers, step, active) in enumerate(leaves):
            if not param.size:
                out[i] = (param, {"step": jnp.where(active, step + one, step), **buffers}, window.accs[i])
        for indices in _batches(leaves):
            group = [leaves[i] for i in indices]
            at = np.asarray(indices)
            part = window._replace(
                accs=[window.accs[i] for i in indices],
                present=_pick(window.present, at),
                divisor=_pick(window.divisor, at),
            )
            for i, result in zip(indices, kernel(group, hparams_of(group[0][0].dtype), static, one, part)):
                out[i] = result
        return out

    return fused_window


def _pick(x: Any, at: np.ndarray) -> Any:
    # a per-parameter vector's entries for one kernel call; a static value as it is
    return x if x is None or isinstance(x, int) else x[at]


def window_ready(params: list[jax.Array]) -> bool:
    """Whether ``fused_window`` can take a call over ``params``: every non-empty one is
    a kernel leaf (otherwise grad_accumulate runs the jitted path)."""
    return all(kernel_leaf(p) or not p.size for p in params)


def sgd_kernel(
    leaves: list[Leaf],
    hp: Mapping[str, Any],
    static: Mapping[str, Any],
    one: jax.Array,
    window: Window | None = None,
) -> list:
    """SGD's rule (``_sgd._step_leaf``) for every parameter of one dtype, one kernel call,
    from the rule's own prepared scalars (``_sgd._prepare``): the same rounding."""
    steps = jnp.stack([leaf[3] for leaf in leaves]) + one
    active = jnp.stack([leaf[4] for leaf in leaves])
    return _call(
        "fo_sgd",
        leaves,
        ["momentum_buffer"] if static["has_momentum"] else [],
        [hp["neg_lr"], hp["momentum"], hp["one_minus_dampening"], hp["weight_decay"]],
        [active, hp["use_weight_decay"], steps == 1, hp["use_momentum"]],
        window,
        has_momentum=static["has_momentum"],
        nesterov=static["nesterov"],
        maximize=static["maximize"],
    )


def adam_kernel(
    leaves: list[Leaf],
    hp: Mapping[str, Any],
    static: Mapping[str, Any],
    one: jax.Array,
    window: Window | None = None,
) -> list:
    """Adam's and AdamW's rule (``_adam._step_leaf``) for every parameter of one dtype, from
    the rule's prepared scalars (``_adam._prepare``); bias corrections from each
    parameter's own step, as the rule computes them."""
    c = caster(leaves[0][0].dtype)
    lr, (beta1, beta2) = hp["lr"], hp["betas"]
    t = step_as_float(jnp.stack([leaf[3] for leaf in leaves]) + one, hp)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    scalars = [
        hp.get("param_decay", 1),  # only one of the two decays exists (static)
        hp.get("weight_decay", 0),
        hp["lerp_weight"],
        hp["lerp_one_minus_weight"],
        hp["beta2"],
        hp["one_minus_beta2"],
        1 / c(jnp.sqrt(bias_correction2)),
        hp["eps"],
        -(lr / bias_correction1),
    ]
    flags = [jnp.stack([leaf[4] for leaf in leaves]), hp["use_weight_decay"], hp["lerp_small_weight"]]
    return _call(
        "fo_adam",
        leaves,
        ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if static["amsgrad"] else []),
        scalars,
        flags,
        window,
        maximize=static["maximize"],
        decoupled=static["decoupled_weight_decay"],
        amsgrad=static["amsgrad"],
    )


def adagrad_kernel(
    leaves: list[Leaf],
    hp: Mapping[str, Any],
    static: Mapping[str, Any],
    one: jax.Array,
    window: Window | None = None,
) -> list:
    """Adagrad's rule (``_adagrad._step_leaf``) for every parameter of one dtype; the
    decayed rate ``lr / (1 + (step - 1) * lr_decay)`` from each parameter's own step, in
    the hyperparameters' dtype, as the rule computes it."""
    lr = hp["lr"]
    t = step_as_float(jnp.stack([leaf[3] for leaf in leaves]) + one, hp)
    clr = lr / (1 + (t - 1) * hp["lr_decay"])
    wd = hp["weight_decay"]
    return _call(
        "fo_adagrad",
        leaves,
        ["sum"],
        [-clr, wd, hp["eps"]],
        [jnp.stack([leaf[4] for leaf in leaves]), wd != 0],
        window,
        maximize=static["maximize"],
    )
