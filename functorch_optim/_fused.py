"""``fused=True``: one-pass CPU kernels for SGD, Adam, AdamW, Adagrad (and RMSprop, whose
default path its kernel is: torch has no fused RMSprop) through XLA's FFI.

XLA's CPU backend cannot fuse a step that writes two arrays into one loop, so a jitted
SGD step reads its inputs twice and Adam's more often (``ANCHORS.md``: ~65 % of the
memory bandwidth). ``fused=True`` replaces the per-parameter rule by a C++ kernel
(``_fused_kernels.cc``) that reads each input once and writes params and buffers in
place, on XLA's own thread pool, with the same operations in the same order, so results
are bit-identical to ``fused=False`` (tests/test_fused.py asserts it).

The kernels are compiled when the package is built (``setup.py``), into a library beside
this module, for every CPU of the architecture (on x86-64 each element loop has an
AVX-512, an AVX2 and a baseline clone, picked when the library loads), with the
library's SHA-256 written beside it by that build. Nothing is compiled at run time. The
library is loaded only after verification (``load_kernels``): a regular file that is no
easier to replace than this module (same owner, this user or root; writable by no one
who cannot write this module) whose bytes match the recorded SHA-256. A library that is
missing or fails verification is not loaded: one ``RuntimeWarning`` says why, and every
optimizer runs its jitted rule, as with ``fused=False``. On other backends (GPU, TPU),
where XLA fuses the step by itself, and for parameter dtypes other than float32/float64,
the ordinary jitted rule runs instead: each kernel call is one equation of the step
(``kernel_or_rule``), lowered to the kernel for the CPU and to the rule for the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib.machinery
import os
import stat
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend import core
from jax.interpreters import batching, mlir

from functorch_optim._base import Algorithm, rule_step
from functorch_optim._hyperparams import fixed, in_use
from functorch_optim._torch_ops import caster, cpu_contracts_fma, decayed_lr, lr_over, step_as_float

try:  # what a traced value's producer is: JAX internals, read for the default's choice only
    from jax._src.interpreters.partial_eval import DynamicJaxprTracer as _JaxprTracer

    if "parent" not in _JaxprTracer.__slots__:
        raise ImportError
except (ImportError, AttributeError, TypeError):  # another JAX: every step may take the kernel

    class _JaxprTracer:  # type: ignore[no-redef]
        parent = None


_HERE = Path(__file__).resolve().parent
_LIBRARY = "_fused_kernels"  # the build's library: _fused_kernels<extension suffix>, beside this module
_TARGETS = {"fo_sgd": "FoSgd", "fo_adam": "FoAdam", "fo_adagrad": "FoAdagrad", "fo_rmsprop": "FoRmsprop"}
_CHECKSUM = ".sha256"  # beside the library: the SHA-256 of its bytes, written by its build
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# Arrays one kernel call writes in place (parameters and buffers), at most: XLA's compile
# time grows faster than linearly in the aliased operands of one call (1000 leaves in one
# call: 39 s; in calls of 128: 3.7 s). Measured on 2 cores (2026-12-07, the calls sharing
# one table), compile of a step over 1000 parameters of 1000 float32 elements in calls of
# 256 / 128 / 64 / 32 arrays: AdamW 2.21 / 1.62 / 1.44 / 1.54 s, SGD with momentum 1.40 /
# 1.03 / 0.99 / 0.97 s; over 100 parameters, SGD 84 / 88 / 77 / 80 ms. Calls of 32 ran
# AdamW's 1000-parameter step in 21 ms against 15-16 (each call waits for its tasks);
# 64 and 128 ran alike over 100, 200 and 1000 parameters.
_ALIASED_PER_CALL = 64


def library_file(directory: Path = _HERE) -> Path | None:
    """The kernel library the package build wrote into ``directory`` (this module's), or
    ``None`` if there is none: ``_fused_kernels`` with one of this interpreter's
    extension-module suffixes (``.cpython-311-x86_64-linux-gnu.so``, ``.so``, …)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / (_LIBRARY + suffix)
        if path.exists():
            return path
    return None


@functools.cache
def load_kernels() -> str | None:
    """Verify and register the fused kernels the package build wrote beside this module.

    Loaded only if the library is a regular file no easier to replace than this module
    (``_check_owned``) and its bytes match the SHA-256 its build recorded beside it
    (``<library>.sha256``). Once per process.

    Returns:
      The path of the loaded library, or ``None`` when it is missing or fails a check
      (after one ``RuntimeWarning`` saying why): the optimizers then run the jitted rule.
    """
    library = library_file()
    try:
        if library is None:
            raise _Unverified(
                f"there is no kernel library {_LIBRARY}*.so in {_HERE} (the package was not built "
                "by its build backend, or the library was removed)"
            )
        fd = _open_verified(library)
        # dlopen the descriptor that was verified, not the path: what loads is those
        # bytes even if the name is replaced meanwhile. The descriptor stays open for the
        # life of the process, so its /proc name never refers to another file.
        proc = Path(f"/proc/self/fd/{fd}")
        try:
            lib = ctypes.CDLL(str(proc) if proc.exists() else str(library))
            capsules = {
                target: jax.ffi.pycapsule(getattr(lib, symbol)) for target, symbol in _TARGETS.items()
            }
        except (OSError, AttributeError) as error:
            raise _Unverified(f"it cannot be loaded ({error})") from None
    except _Unverified as error:
        reason = str(error) if library is None else f"the kernel library {library}: {error}"
        warnings.warn(
            f"functorch_optim's fused CPU kernels are not available: {reason}; "
            "every optimizer runs its jitted rule, as with fused=False (same results, slower on the "
            "CPU). Reinstalling the package builds them.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    for target, capsule in capsules.items():
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    return str(library)


class _Unverified(Exception):
    """A library that must not be loaded; the message says why."""


def _check_owned(st: os.stat_result, what: str) -> None:
    """Raise ``_Unverified`` unless ``st`` is a regular file no easier to replace than this
    module: owned by this module's owner, this user or root, and writable by no group or
    other user that cannot write this module (a library anyone could rewrite would run
    their code in this process)."""
    if not stat.S_ISREG(st.st_mode):
        raise _Unverified(f"{what} is not a regular file")
    module = os.stat(__file__)
    if st.st_uid not in (module.st_uid, os.geteuid(), 0):
        raise _Unverified(
            f"{what} is owned by uid {st.st_uid}, not by this package's owner (uid {module.st_uid}), "
            f"this user (uid {os.geteuid()}) or root"
        )
    if st.st_mode & 0o022 & ~module.st_mode:
        raise _Unverified(
            f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):#o}; "
            f"{Path(__file__).name} has {stat.S_IMODE(module.st_mode):#o})"
        )


def _open_checked(path: Path, what: str) -> int:
    """``path`` opened for reading, without following a symbolic link, after
    ``_check_owned``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise _Unverified(f"{what} cannot be opened ({error.strerror}; a symbolic link is refused)") from None
    try:
        _check_owned(os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _open_verified(library: Path) -> int:
    """``library`` opened, after its checks (``_Unverified`` if it must not be loaded)."""
    fd = _open_checked(library, "it")
    try:
        digest = hashlib.sha256(_read_all(fd)).hexdigest()
        checksum = library.with_name(library.name + _CHECKSUM)
        if not checksum.exists():
            raise _Unverified(f"it has no checksum file beside it ({checksum.name})")
        sum_fd = _open_checked(checksum, f"its checksum file {checksum.name}")
        try:
            recorded = _read_all(sum_fd).decode(errors="replace").strip()
        finally:
            os.close(sum_fd)
        if digest != recorded:
            raise _Unverified(
                f"it does not match the checksum its build recorded (truncated, corrupt or replaced: "
                f"sha256 {digest[:16]}…, recorded {recorded[:16] or 'nothing'}…)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


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


#: XLA's CPU client runs a program inline, on the calling thread, when its cost analysis
#: estimates under 1000 flops (and it counts a custom call as none): a step over fewer
#: elements than this runs inline. ``_async_padding``'s length, and the default's smallest
#: kernel call (``kernel_batches``).
SMALL_STEP = 1024


def _async_padding(param: jax.Array, dtype: Any) -> jax.Array:
    """``SMALL_STEP`` elements the kernel does not read, worth that many flops to XLA's
    cost analysis: an elementwise maximum computed from an element of ``param``, an
    argument of the program (so not a folded constant as the scalars may be). The
    kernel's table (``_call``) ends with them when the call updates at least
    ``SMALL_STEP`` elements.

    XLA's CPU client runs a program it estimates at under 1000 flops inline, on the
    calling thread, and counts a custom call as none: a program that is nothing but the
    kernel call would run inline at every size. JAX's per-call work (flattening the
    arguments, wrapping the outputs, freeing the donated arrays) then waits for the
    kernel instead of overlapping it, as it does the jitted rule's program, which runs
    on XLA's threads from about a thousand elements (its flops). Measured on 2 cores:
    0.62 -> 0.51 ms for SGD over 100 parameters of 1000 elements, 0.88 -> 0.72 ms for
    Adam. Below that size inline is the faster choice, as it is for the rule."""
    flag = jax.lax.stop_gradient(param.ravel()[:1] != 0).astype(dtype)
    return jnp.maximum(np.arange(SMALL_STEP).astype(dtype), flag)


def _as(x: jax.Array, dtype: Any) -> jax.Array:
    # ``x.astype(dtype)``, without its trace-time cost where it is the identity (a call
    # over hundreds of gradients)
    return x if x.dtype == dtype else x.astype(dtype)


def _call(
    target: str,
    leaves: list[Leaf],
    names: list[str],
    scalars: list,
    flags: list,
    window: Window | None = None,
    delta: bool = False,
    **attrs: bool,
) -> list[tuple[jax.Array, ...]]:
    """The kernel calls for ``leaves`` (one dtype): one table of scalars, and a call per
    ``_ALIASED_PER_CALL`` arrays written in place.
    ``scalars`` / ``flags``: per-parameter values, each a scalar (the same for all) or a
    vector over the leaves. Per leaf ``(param, buffers)``, with a ``window`` ``(param,
    buffers, accumulator)``. With ``delta`` (``update``, no window) the parameters are
    only read and each leaf's first result is its update ``new - param``, written over
    its gradient (``FusedStep``)."""
    dtype = leaves[0][0].dtype
    count = len(leaves)
    params = [leaf[0] for leaf in leaves]
    kinds = [[leaf[2][n] for leaf in leaves] for n in names]
    if window is None:
        grads = [_as(leaf[1], dtype) for leaf in leaves]
    else:
        # a parameter without a gradient in this call gets a one-element stand-in
        grads = [jnp.zeros((1,), dtype) if leaf[1] is None else _as(leaf[1], dtype) for leaf in leaves]
        has_grad = window.present
        if has_grad is None:
            has_grad = np.asarray([leaf[1] is not None for leaf in leaves])
        kinds.append(list(window.accs))
        weight = 1 if window.weight is None else window.weight
        scalars = [*scalars, window_scale(window.divisor, dtype), weight]
        flags = [*flags, has_grad, window.fresh, window.stepping, window.weight is not None]
    # one table for every call, one XLA kernel to compile (~5-10 ms each): the scalars then
    # the flags (0 or 1) in the parameters' dtype, one row that every parameter reads
    # where each is the same for all (no per-parameter counter, mask or window flag), else
    # a row per parameter; then the async padding. Built by selects over a column index:
    # XLA fused a stack of up to 8 columns into one kernel, a wider one (Adam's 12,
    # RMSprop's 11) into a kernel a column. Compile of the default step over 100
    # parameters (2 cores, 2026-12-07), stack -> selects: AdamW 138 -> 114 ms, RMSprop
    # 103 -> 69 ms; a row of broadcast columns compiled ~10 ms slower than the one row
    c = caster(dtype)
    columns = [c(x).astype(dtype) for x in scalars] + [jnp.asarray(x).astype(dtype) for x in flags]
    one_row = all(x.ndim == 0 for x in columns)
    shape = (1 if one_row else count, len(columns))
    at_column = jax.lax.broadcasted_iota(np.int32, shape, 1)
    spread = lambda x: jax.lax.broadcast_in_dim(x, shape, tuple(range(x.ndim)))
    table = spread(columns[-1])
    for j in reversed(range(len(columns) - 1)):
        table = jax.lax.select(at_column == j, spread(columns[j]), table)
    table = table.ravel()
    if sum(x.size for x in params) >= SMALL_STEP:
        table = jnp.concatenate([table, _async_padding(params[0], dtype)])
    out: list[tuple[jax.Array, ...]] = []
    per_call = max(1, _ALIASED_PER_CALL // (1 + len(kinds)))
    for first in range(0, count, per_call):
        at = slice(first, first + per_call)
        n = len(params[at])
        written = [*params[at], *(b for kind in kinds for b in kind[at])]
        results = jax.ffi.ffi_call(
            target,
            [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in written],
            # params (delta: grads) -> outputs 0..n-1, then buffers (the grads sit between)
            input_output_aliases={
                **{(n if delta else 0) + i: i for i in range(n)},
                **{2 * n + j: n + j for j in range(len(written) - n)},
            },
            vmap_method="sequential",
        )(
            *params[at],
            *grads[at],
            *written[n:],
            table,
            count=np.int64(n),
            first_row=np.int64(first),
            one_row=one_row,
            window=window is not None,
            delta=delta,
            **attrs,
        )
        out += [
            (
                results[i],
                {m: results[n + k * n + i] for k, m in enumerate(names)},
                *([] if window is None else [results[n + len(names) * n + i]]),
            )
            for i in range(n)
        ]
    return out


def fused_algorithm(algorithm: Algorithm, kernel: Callable[..., Any], auto: bool = False) -> Algorithm:
    """``algorithm`` with ``kernel`` as its ``fused_step``. With ``fused=True`` it loads
    the kernel library now, so that a missing one is reported (one warning) at
    construction; the default loads it when a step is first traced (so that building an
    optimizer, e.g. at import, never warns); without it the fused step runs the jitted
    rule. ``auto`` (``fused=None``): not where several CPU devices could shard the step
    either (``_kernels_apply``), nor for a dtype's parameters of fewer than
    ``SMALL_STEP`` elements in all (``kernel_batches``). (torch's "floating point params
    only" check for ``fused`` is every optimizer's here.)"""
    if not auto:  # the default loads the library when a step is first traced
        load_kernels()
    return dataclasses.replace(
        algorithm,
        fused_step=FusedStep(kernel, algorithm, auto),
        fused_window=FusedWindow(kernel, auto),
    )


def _kernels_apply(auto: bool) -> bool:
    """Whether a step traced now takes the kernels: the library is loaded, and for the
    default (``auto``) the process has one CPU device. With several, automatic (SPMD)
    sharding may split the parameters, which a trace cannot see, and the kernel has no
    partitioning rule (XLA would gather every parameter onto every device), so the
    default runs the jitted rule there; ``fused=True`` still takes the kernel."""
    return load_kernels() is not None and not (auto and jax.device_count("cpu") > 1)


def kernel_or_rule(kernel: Callable[..., Any], rule: Callable[..., Any], *args: Any, like: Any = None) -> Any:
    """``kernel(*args)`` on the CPU and ``rule(*args)`` elsewhere, differentiable: its JVP
    (and so ``jax.grad``, ``jax.jvp``, ``jax.hessian``) is ``rule``'s, as the kernel call
    has no derivative and the two give the same bits. ``args`` are pytrees; their array
    leaves are the function's arguments (what is differentiated), any other leaf (a
    Python number, a flag) a constant.

    Without ``like``, both are traced now, as ``jax.lax.platform_dependent`` does. With
    ``like`` (a pytree of arrays of the result's structure, shapes and dtypes: what the
    call updates), neither is: one ``_kernel_or_rule_p`` equation stands for the call,
    and lowering traces the function of the platform it lowers for (the kernel on the
    CPU, the rule elsewhere; both where one lowering serves several platforms). Both must
    then take every traced value from ``args``, closing over none. Traced with the step,
    the rule beside the kernel took most of a CPU step's tracing (1000 SGD parameters:
    0.22 s; 0.05 s without)."""
    leaves, treedef = jax.tree.flatten(args)
    # each array once (a counter shared by every parameter is one operand), any other
    # leaf a constant
    arrays: list[Any] = []
    slots: list[int | None] = []
    index: dict[int, int] = {}
    for x in leaves:
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            slots.append(index.setdefault(id(x), len(arrays)))
            if slots[-1] == len(arrays):
                arrays.append(x)
        else:
            slots.append(None)

    def rebuild(values):
        return treedef.unflatten([x if k is None else values[k] for x, k in zip(leaves, slots)])

    if like is not None:
        like_leaves, out_tree = jax.tree.flatten(like)
        out_avals = tuple(jax.typeof(x).update(weak_type=False) for x in like_leaves)

    def flat(fn):
        def call(*values):
            out, tree = jax.tree.flatten(fn(*rebuild(values)))
            if tree != out_tree:
                raise AssertionError(f"kernel_or_rule: {fn} returned {tree}, not {out_tree}")
            return out

        return call

    @jax.custom_jvp
    def run(*arrays):
        if like is None:  # both traced now: they may close over values being traced
            return jax.lax.platform_dependent(*rebuild(arrays), cpu=kernel, default=rule)
        out = _kernel_or_rule_p.bind(
            *arrays, kernel=flat(kernel), rule=flat(rule), out_avals=out_avals, config=_trace_config()
        )
        return out_tree.unflatten(out)

    @functools.partial(run.defjvp, symbolic_zeros=True)
    def run_jvp(primals, tangents):
        # only the arguments that carry a tangent are differentiated: the others stay
        # constants, as in the rule's own derivative (a zero tangent made explicit would
        # add ``0 * x`` terms that XLA contracts differently)
        live = [not isinstance(t, SymbolicZero) for t in tangents]

        def of_live(*values):
            it = iter(values)
            return rule(*rebuild([next(it) if on else p for p, on in zip(primals, live)]))

        pick = lambda xs: tuple(x for x, on in zip(xs, live) if on)
        return jax.jvp(of_live, pick(primals), pick(tangents))

    return run(*arrays)


def _either(
    *args: jax.Array, kernel: Callable, rule: Callable, out_avals: tuple, config: tuple
) -> list[jax.Array]:
    """The call as ``jax.lax.platform_dependent`` (both traced): run outside ``jit``
    (the platform is known then, and only its branch runs) and under ``jax.vmap``."""
    return jax.lax.platform_dependent(*args, cpu=kernel, default=rule)


# the settings a function's trace depends on, as the step's trace saw them; its lowering
# traces under them again (a step traced under ``jax.enable_x64`` and lowered after it
# would otherwise trace the kernel's float64 scalars as float32)
_TRACE_SETTINGS = (
    jax.enable_x64,
    jax.numpy_dtype_promotion,
    jax.numpy_rank_promotion,
    jax.default_matmul_precision,
)


def _trace_config() -> tuple:
    return tuple(setting.value for setting in _TRACE_SETTINGS)


def _lowering(which: str) -> Callable:
    def lower(ctx, *args, config, **params):
        with contextlib.ExitStack() as stack:
            for setting, value in zip(_TRACE_SETTINGS, config):
                stack.enter_context(setting(value))
            return mlir.lower_fun(params[which], multiple_results=True)(ctx, *args)

    return lower


# ``kernel_or_rule``'s call: ``kernel`` or ``rule`` (arrays -> a flat list of arrays of
# ``out_avals``), each traced when it is lowered, for its platform, under ``config``
_kernel_or_rule_p = core.Primitive("functorch_optim_kernel_or_rule")
_kernel_or_rule_p.multiple_results = True
_kernel_or_rule_p.def_impl(_either)
_kernel_or_rule_p.def_abstract_eval(lambda *avals, out_avals, **_: list(out_avals))
mlir.register_lowering(_kernel_or_rule_p, _lowering("kernel"), platform="cpu")
mlir.register_lowering(_kernel_or_rule_p, _lowering("rule"))
batching.primitive_batchers[_kernel_or_rule_p] = lambda args, dims, **params: (
    jax.vmap(functools.partial(_either, **params), in_axes=tuple(dims))(*args),
    [0] * len(params["out_avals"]),
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


def computed_in_trace(params: list[Any], grads: list[Any]) -> bool:
    """Whether the program being traced computes some of ``grads`` from ``params`` (a
    whole training step: forward, backward and the optimizer step in one ``jit``) rather
    than taking them as its arguments (a step jitted on its own, ``fo.jit_step``, the
    facade) or computing them from other values only (a clipping transformation before
    this one, ``grad_accumulate``'s accumulator plus the gradient).

    There the default runs the jitted rule (``rule_in_trace``): XLA fuses each parameter's update into the
    backward pass and runs it as soon as that gradient exists, beside the rest of the
    backward pass, where one kernel call over many parameters waits for the last of
    their gradients and reads every one back from memory (measured on 2 cores: an MLP
    of 8 layers of 1024x1024, AdamW, forward + backward 31.4 ms, with the rule 33.4 ms,
    with the kernel 41.8 ms, though the kernel's step alone took 5.5 ms to the rule's
    8.4). A value computed in the trace is a jaxpr tracer with a producing equation
    (``parent``), whose inputs lead back to the trace's arguments; arguments, constants
    and every other kind of tracer (``vmap``, ``jvp``) keep the kernel.
    """
    targets = {id(p) for p in params if isinstance(p, _JaxprTracer)}
    todo = [g for g in grads if isinstance(g, _JaxprTracer)]
    seen: set[int] = set()
    while targets and todo:
        eqn = todo.pop().parent
        if eqn is None or id(eqn) in seen:
            continue
        seen.add(id(eqn))
        for x in getattr(eqn, "in_tracers", ()):
            if id(x) in targets:
                return True
            if isinstance(x, _JaxprTracer):
                todo.append(x)
    return False


#: ``rule_for_update``: from this many elements of a dtype's copied gradients the rule
#: runs ``update`` instead of the kernel
COPY_LIMIT = 1 << 20


def held_outside(x: Any) -> bool:
    """Whether ``x`` is an argument or a constant of the program being traced (a jaxpr
    tracer that no equation of the trace produced): XLA keeps its buffer, so a kernel
    output aliasing it writes over a copy."""
    return isinstance(x, _JaxprTracer) and x.parent is None


def rule_for_update(params: list[Any], grads: list[Any], fused_fmas: bool = True) -> set[int]:
    """For the default's ``update`` (``FusedStep`` with ``delta``): the parameters that run
    the jitted rule although the kernel applies. Those whose gradient is an argument of
    the trace (``held_outside``: a step jitted with the gradients passed in), where the
    kernel, which writes the update over the gradient, would work on a copy, a new
    buffer on every step; the rule computes the update in XLA's own loops. Where the
    rule's fused multiply-adds are FMA instructions (``cpu_contracts_fma``) it does for
    all of them; where they are the exact emulation (slow to compile: AdamW over 1000
    parameters of 1000 elements through ``update``, 20.5 s to the kernel's 2.7 s), from
    ``COPY_LIMIT`` elements of such gradients in the dtype: measured on 2 cores
    (AVX-512, no contraction), ``update`` + ``optax.apply_updates`` over one parameter,
    rule against kernel: 10M elements, plain SGD 3.0 against 23 ms, Adam 10.4 against
    23 ms (the copy is new memory on every step: 9767 page faults); 1M, plain SGD 0.24
    against 0.41 ms, Adam 1.47 against 0.65 ms. A rule without fused multiply-adds
    (``fused_fmas`` false, ``Algorithm.fused_fmas``: SGD without momentum, Adagrad)
    emulates nothing and runs at every size: 1M elements in one leaf, plain SGD 0.35 ms
    against the kernel's 0.62-0.71 (optax 0.33), Adagrad 0.68 against 1.09 (optax 0.59);
    100 of 1k, 0.32 against 0.36 and 0.48 against 0.51 (2026-12-07)."""
    outside: dict[Any, list[int]] = {}
    for i, (param, grad) in enumerate(zip(params, grads)):
        if kernel_leaf(param) and held_outside(grad):
            outside.setdefault(param.dtype, []).append(i)
    return {
        i
        for dtype, indices in outside.items()
        if not fused_fmas or cpu_contracts_fma(dtype) or sum(params[i].size for i in indices) >= COPY_LIMIT
        for i in indices
    }


def rule_in_trace(params: list[Any], grads: list[Any], bare: bool = False) -> bool:
    """For the default: whether a step traced now runs the jitted rule although the kernels
    apply. Where the program computes the gradients (``computed_in_trace``), and the
    rule's fused multiply-adds are FMA instructions on this CPU (``cpu_contracts_fma``,
    for each dtype the kernel would take), or the rule is ``bare``: it computes no fused
    multiply-add and keeps no buffer (SGD without momentum: one multiply-add of the
    parameter and the gradient, which XLA fuses into the loop that produces the gradient,
    where the kernel reads every gradient back from memory).

    Where the probe sends the rule to the exact emulation instead, the kernel is the
    cheaper program there (measured on an AVX-512 CPU, 2 cores, the bench's 200-leaf MLP
    whole step, 2026-12-07): with AdamW the emulating rule compiled in 4.81 s and the
    kernel in 1.30 s (optax 1.94 s), running at 1.07x and 1.09x optax's time; with
    Adagrad (a buffer, no fused multiply-add) the rule ran at 1.00x optax and compiled in
    1.55 s, the kernel at 0.96-0.97x in 0.82 s (optax 1.29 s); plain SGD, bare, ran at
    0.98-1.00x with the rule and 1.06-1.09x with the kernel (12-layer transformer: all
    three within 0.97-1.00x, its step is the model's). The kernel rounds like torch at
    every magnitude (the emulation rounds twice below 2**-78, 2**-916 in float64)."""
    if not computed_in_trace(params, grads):
        return False
    return bare or all(cpu_contracts_fma(d) for d in {p.dtype for p in params if kernel_leaf(p)})


def kernel_batches(params: list[jax.Array], auto: bool) -> list[list[int]]:
    """The indices of the parameters that take the kernel, one list per dtype (its kernel
    calls share one table: ``_call``): the kernel leaves (``kernel_leaf``). For the
    default (``auto``) a dtype whose kernel leaves have fewer than ``SMALL_STEP``
    elements in all runs the jitted rule instead: a step that small runs inline either
    way (``_async_padding``), where the rule's program is the cheaper call (measured: a
    Linear(10, 1), Adam 25 us a step against the kernel's 35)."""
    groups: dict[Any, list[int]] = {}
    for i, param in enumerate(params):
        if kernel_leaf(param):
            groups.setdefault(param.dtype, []).append(i)
    if auto:
        groups = {d: v for d, v in groups.items() if sum(params[i].size for i in v) >= SMALL_STEP}
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class FusedStep:
    """A fused algorithm's ``Algorithm.fused_step``: ``kernel``, the calls of one table
    per dtype (``_call``) on the CPU for the float32/float64 parameters; elsewhere, and
    for every other parameter, ``algorithm``'s jitted per-parameter rule and the mask.

    A value, not a closure: it pickles (a facade with ``fused=True`` does) and two equal
    configurations share one compiled step.
    """

    kernel: Callable[..., list[tuple[jax.Array, dict[str, jax.Array]]]]
    algorithm: Algorithm
    auto: bool = False  # fused=None: see _kernels_apply, kernel_batches

    def __call__(
        self, leaves: list[Leaf], hparams_of, static, one: jax.Array, delta: bool = False
    ) -> list[tuple[jax.Array, dict[str, jax.Array]]]:
        """Per leaf ``(new param, buffers)``; with ``delta`` (``update``) ``(new param -
        param, buffers)``, the kernel writing the update over the gradient
        (``_call``): the parameters stay as they are, so a kernel that wrote them in place
        would work on a copy, a new buffer the size of the parameters on every step (on
        2 cores, Adam over 10M parameters through ``update``: 21 ms a step, 9767 page
        faults, against 4.5 ms through ``fo.step``). For the default, where the gradient
        is an argument of the trace, XLA would copy it: ``rule_for_update``."""
        kernel, algorithm = self.kernel, self.algorithm
        # load_kernels registers the targets (also in a process that unpickled this step);
        # without the library every parameter takes the rule
        # (for the default: not where this trace computes the gradients, rule_in_trace)
        params, grads = [leaf[0] for leaf in leaves], [leaf[1] for leaf in leaves]
        fmas = bool(algorithm.for_static("fused_fmas", static))
        bare = not fmas and not any(leaf[2] for leaf in leaves)
        kernels = _kernels_apply(self.auto) and not (self.auto and rule_in_trace(params, grads, bare))
        batches = []
        if kernels:
            ruled = rule_for_update(params, grads, fmas) if delta and self.auto else set()
            owned = [i for i in range(len(leaves)) if i not in ruled]
            batches = [[owned[j] for j in b] for b in kernel_batches([params[i] for i in owned], self.auto)]
        taken = {i for indices in batches for i in indices}

        def rule(leaf, hparams_of, one):
            new, buffers = rule_step(algorithm, leaf, hparams_of, static, one)
            return (new - leaf[0] if delta else new), buffers

        out: list[Any] = [None] * len(leaves)
        for i, leaf in enumerate(leaves):
            if i not in taken:
                out[i] = rule(leaf, hparams_of, one)
        for indices in batches:
            group = [leaves[i] for i in indices]
            hp = hparams_of(group[0][0].dtype)
            results = kernel_or_rule(
                lambda g, h, one: kernel(g, h, static, one, delta=delta),
                lambda g, h, one: [rule(leaf, lambda _: h, one) for leaf in g],
                group,
                hp,
                one,
                like=[(leaf[0], leaf[2]) for leaf in group],
            )
            for i, result in zip(indices, results):
                out[i] = result
        return out


@dataclasses.dataclass(frozen=True)
class FusedWindow:
    """A fused algorithm's ``Algorithm.fused_window``: ``grad_accumulate``'s calls in
    ``kernel`` (a value, like ``FusedStep``)."""

    kernel: Callable[..., list]
    auto: bool = False  # fused=None: see _kernels_apply, kernel_batches

    def ready(self, params: list[jax.Array], grads: list[Any] = ()) -> bool:
        """Whether this can take a call over ``params`` with ``grads``: the kernels apply,
        every non-empty parameter takes the kernel (``kernel_batches``: one call covers
        every parameter, so a tree with a bfloat16 one, or for the default a dtype of
        fewer than ``SMALL_STEP`` elements, runs the jitted path), and for the default the
        trace does not compute the gradients (``computed_in_trace``); otherwise
        grad_accumulate runs the jitted path, whose closing call steps through
        ``FusedStep`` (the kernel or the rule, as a plain step decides).

        In a whole training step the jitted path adds each gradient into its accumulator
        inside the backward pass, as soon as it exists and while it is in cache; the window
        kernel waits for the last gradient and reads every one back from memory. The add
        has no FMA, so this holds on every CPU: measured on 2 cores (AVX-512, where the
        rule emulates its FMAs, so the closing call steps with the kernel either way), the
        bench's 200-leaf MLP with AdamW, ``every=4``: micro-step 19.7 against 24.3 ms,
        closing call 23.0 against 26.3 ms, compile 1.08 against 1.40 s, the same bits."""
        if not _kernels_apply(self.auto) or (self.auto and computed_in_trace(params, grads)):
            return False
        taken = {i for indices in kernel_batches(params, self.auto) for i in indices}
        return all(i in taken or not p.size for i, p in enumerate(params))

    def __call__(
        self, leaves: list[Leaf], window: Window, hparams_of, static, one: jax.Array
    ) -> list[tuple[jax.Array, dict[str, jax.Array], jax.Array]]:
        # every non-empty parameter is a kernel leaf (``ready``); an empty one has
        # nothing to update (the engine advances every counter)
        out: list[Any] = [None] * len(leaves)
        for i, (param, _, buffers, _, _) in enumerate(leaves):
            if not param.size:
                out[i] = (param, buffers, window.accs[i])
        for indices in kernel_batches([leaf[0] for leaf in leaves], auto=False):
            group = [leaves[i] for i in indices]
            at = np.asarray(indices)
            part = window._replace(
                accs=[window.accs[i] for i in indices],
                present=_pick(window.present, at),
                divisor=_pick(window.divisor, at),
            )
            for i, result in zip(
                indices, self.kernel(group, hparams_of(group[0][0].dtype), static, one, part)
            ):
                out[i] = result
        return out


def _per_leaf(values: list[Any], absent: Any = None) -> Any:
    """A kernel call's per-parameter ``values`` (step counters, mask flags) as one operand:
    the value itself where every parameter has the same (one object: a shared counter, or
    ``None``, which is ``absent``), else their vector."""
    first = values[0]
    if all(v is first for v in values):
        return absent if first is None else first
    return jnp.stack([absent if v is None else v for v in values])


def _counters(leaves: list[Leaf]) -> Any:
    """The call's step counters (``_per_leaf``)."""
    return _per_leaf([leaf[3] for leaf in leaves])


def _active(leaves: list[Leaf]) -> Any:
    """The call's "takes this step" flags (``grad_mask``; none: every parameter steps)."""
    return _per_leaf([leaf[4] for leaf in leaves], absent=True)


def _pick(x: Any, at: np.ndarray) -> Any:
    # a per-parameter vector's entries for one kernel call; a static value as it is
    return x if x is None or isinstance(x, int) else x[at]


def sgd_kernel(
    leaves: list[Leaf],
    hp: Mapping[str, Any],
    static: Mapping[str, Any],
    one: jax.Array,
    window: Window | None = None,
    delta: bool = False,
) -> list:
    """SGD's rule (``_sgd._step_leaf``) for every parameter of one dtype, its kernel calls
    (``_call``), from the rule's own prepared scalars (``_sgd._prepare``): the same rounding."""
    # only the momentum buffer's first step reads the counters (without a buffer the
    # state keeps none: ``_base.keeps_step``)
    first = _counters(leaves) + one == 1 if static["has_momentum"] else False
    return _call(
        "fo_sgd",
        leaves,
        ["momentum_buffer"] if static["has_momentum"] else [],
        [hp["neg_lr"], hp["momentum"], hp["one_minus_dampening"], hp["weight_decay"]],
        [
            _active(leaves),
            jnp.asarray(hp["use_weight_decay"]),
            first,
            jnp.asarray(hp["use_momentum"]),
        ],
        window,
        delta,
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
    delta: bool = False,
) -> list:
    """Adam's and AdamW's rule (``_adam._step_leaf``) for every parameter of one dtype, from
    the rule's prepared scalars (``_adam._prepare``); bias corrections from each
    parameter's own step, as the rule computes them."""
    c = caster(leaves[0][0].dtype)
    lr, (beta1, beta2) = hp["lr"], hp["betas"]
    t = step_as_float(_counters(leaves) + one, hp)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    scalars = [
        hp.get("param_decay", 1),  # only one of the two decays exists (static)
        hp.get("weight_decay", 0),
        hp["lerp_weight"],
        hp["lerp_one_minus_weight"],
        hp["beta2"],
        hp["one_minus_beta2"],
        c(jnp.sqrt(bias_correction2)),
        hp["eps"],
        -lr_over(lr, bias_correction1, static),
    ]
    flags = [
        _active(leaves),
        jnp.asarray(hp["use_weight_decay"]),
        hp["lerp_small_weight"],
    ]
    return _call(
        "fo_adam",
        leaves,
        ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if static["amsgrad"] else []),
        scalars,
        flags,
        window,
        delta,
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
    delta: bool = False,
) -> list:
    """Adagrad's rule (``_adagrad._step_leaf``) for every parameter of one dtype; the
    decayed rate ``lr / (1 + (step - 1) * lr_decay)`` from each parameter's own step, in
    the hyperparameters' dtype, as the rule computes it."""
    t = step_as_float(_counters(leaves) + one, hp)
    clr = decayed_lr(hp["lr"], t, hp["lr_decay"], static)
    wd = hp["weight_decay"]
    return _call(
        "fo_adagrad",
        leaves,
        ["sum"],
        [-clr, wd, hp["eps"]],
        [
            _active(leaves),
            jnp.asarray(in_use(static, hp, "weight_decay")),
        ],
        window,
        delta,
        maximize=static["maximize"],
    )


def rmsprop_kernel(
    leaves: list[Leaf],
    hp: Mapping[str, Any],
    static: Mapping[str, Any],
    one: jax.Array,
    window: Window | None = None,
    delta: bool = False,
) -> list:
    """RMSprop's rule (``_rmsprop._step_leaf``) for every parameter of one dtype, with the
    rule's scalars cast as the rule casts them: ``1 - alpha`` in the hyperparameters' dtype
    then the parameter's, and the lerp's ``1 - weight`` in the parameter's."""
    c = caster(leaves[0][0].dtype)
    one_minus_alpha = c(1 - hp["alpha"])
    has_momentum, centered = static["has_momentum"], static["centered"]
    if not has_momentum:
        use_momentum = False
    elif fixed(static, "momentum") == "nonzero":
        use_momentum = True
    else:
        use_momentum = hp["momentum"] > 0
    return _call(
        "fo_rmsprop",
        leaves,
        ["square_avg"] + (["momentum_buffer"] if has_momentum else []) + (["grad_avg"] if centered else []),
        [
            hp["alpha"],
            one_minus_alpha,
            1 - one_minus_alpha,
            hp["eps"],
            -hp["lr"],
            hp["weight_decay"],
            hp["momentum"],
        ],
        [
            _active(leaves),
            jnp.asarray(in_use(static, hp, "weight_decay")),
            jnp.asarray(use_momentum),
            jnp.abs(one_minus_alpha) < 0.5,
        ],
        window,
        delta,
        has_momentum=has_momentum,
        centered=centered,
        maximize=static["maximize"],
    )
