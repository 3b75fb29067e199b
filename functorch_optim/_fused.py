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
the jaxlib version, the compiler, its flags and the CPU features ``-march=native``
resolves to (``library_path``, ``target_features``). A cached library is loaded only
after verification (``load_kernels``): a directory and file of this user that no one
else can write, and bytes that match the SHA-256 its build recorded; anything else is
rebuilt (or, in a directory others can write, refused). On other backends (GPU, TPU),
where XLA fuses the step by itself, and for parameter dtypes other than float32/float64,
the ordinary jitted rule runs instead (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX: no lock (a build still commits by atomic rename)
    fcntl = None

from functorch_optim._base import Algorithm, rule_step
from functorch_optim._torch_ops import caster, lr_over, step_as_float

SOURCE = Path(__file__).with_name("_fused_kernels.cc")
_TARGETS = {"fo_sgd": "FoSgd", "fo_adam": "FoAdam", "fo_adagrad": "FoAdagrad"}
_FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
_CHECKSUM = ".sha256"  # beside the library: the SHA-256 of its bytes, written by its build
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


# options of the compiler proper whose value is the next word (clang's ``-cc1``, gcc's ``cc1plus``)
_VALUE_OPTIONS = ("--param", "-target-cpu", "-target-feature", "-tune-cpu", "-triple", "-target-abi")


def target_features(compiler: str, flags: tuple[str, ...]) -> str:
    """The code-generation target that ``flags`` select on this machine, as ``compiler``
    resolves it: ``-march=native`` becomes the CPU's model and feature flags (gcc's
    ``-march=rocketlake -mavx512f … --param l1-cache-size=48``, clang's ``-target-cpu`` and
    ``-target-feature`` words), read from the compiler driver's ``-###`` output.

    Raises:
      RuntimeError: neither the compiler's output nor ``/proc/cpuinfo`` tells the CPU's
        features (the cache could not keep builds for different CPUs apart).
    """
    command = [compiler, *flags, "-###", "-x", "c++", "-c", os.devnull, "-o", os.devnull]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    words: list[str] = []
    for line in result.stderr.splitlines():
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue
        if not tokens or not (Path(tokens[0]).name.startswith("cc1") or "-cc1" in tokens):
            continue
        rest = iter(tokens[1:])
        for token in rest:
            if token in _VALUE_OPTIONS:
                words.append(f"{token} {next(rest, '')}")
            elif token.startswith("-m") and not token.startswith("-main-file-name"):
                words.append(token)
    if not words:  # a driver that prints no compiler line: the kernel's view of the CPU
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        except OSError:
            cpuinfo = []
        words = sorted({line for line in cpuinfo if line.split(":")[0].strip() in ("flags", "Features")})
    if not words:
        raise RuntimeError(
            f"fused=True could not tell which CPU features {' '.join(flags)} selects on this machine "
            f"({' '.join(command)} printed no compiler command and /proc/cpuinfo is unreadable), so a "
            "cached kernel built on another CPU could not be told apart; use fused=False"
        )
    return " ".join(words)


def library_path(compiler: str, flags: tuple[str, ...], target: str) -> Path:
    """Where the kernel library built by ``compiler`` with ``flags`` for ``target``
    (``target_features``) is cached: under ``$FUNCTORCH_OPTIM_CACHE``, named by a hash of
    the source, jaxlib's version, the compiler, the flags and the CPU features the build
    uses (a change of any is another file: a cache shared by machines with different CPUs
    holds one build per CPU)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jax.lib.__version__, compiler, " ".join(flags), target):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    return _cache_dir() / f"fused_kernels-{key.hexdigest()[:16]}.so"


@functools.cache
def load_kernels() -> str:
    """Build (once per source/jaxlib/compiler/CPU), verify and register the fused kernels.

    The library is loaded only after its bytes match the SHA-256 recorded beside it
    (``<library>.sha256``) by the build that wrote it, from a cache directory and file
    owned by this user and writable by no one else; a file that fails (truncated, empty,
    corrupt, without a checksum, replaced) is rebuilt, with a ``RuntimeWarning`` naming it.

    Returns:
      The path of the shared library.

    Raises:
      RuntimeError: no C++ compiler; the build failed (the compiler's output is shown);
        the cache directory is not this user's or others can write it; or a cached file
        failed verification and could not be rebuilt.
    """
    compiler = _compiler()
    library = library_path(compiler, _FLAGS, target_features(compiler, _FLAGS))
    fd = _verified_library(compiler, library)
    # dlopen the descriptor that was verified (or written), not the path: what loads is
    # those bytes even if the name is replaced meanwhile. The descriptor stays open for
    # the life of the process, so its /proc name never refers to another file.
    proc = Path(f"/proc/self/fd/{fd}")
    lib = ctypes.CDLL(str(proc) if proc.exists() else str(library))
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return str(library)


class _Unverified(Exception):
    """A cached file that must not be loaded; the message says why."""


def _check_owned(st: os.stat_result, what: str) -> None:
    """Raise ``_Unverified`` unless ``st`` is a regular file of this user that no one else
    can write."""
    if not stat.S_ISREG(st.st_mode):
        raise _Unverified(f"{what} is not a regular file")
    if st.st_uid != os.geteuid():
        raise _Unverified(f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise _Unverified(f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):#o})")


def _open_checked(directory: int, name: str, what: str) -> int:
    """``name`` in ``directory`` opened for reading, without following a symbolic link."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
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


def _open_verified(directory: int, name: str) -> int:
    """The cached library ``name`` opened, after its checks: ``FileNotFoundError`` if it
    is absent, ``_Unverified`` if it must not be loaded."""
    fd = _open_checked(directory, name, "it")
    try:
        digest = hashlib.sha256(_read_all(fd)).hexdigest()
        try:
            sum_fd = _open_checked(directory, name + _CHECKSUM, f"its checksum file {name + _CHECKSUM}")
        except FileNotFoundError:
            raise _Unverified(f"it has no checksum file beside it ({name + _CHECKSUM})") from None
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


def _trusted_directory(path: Path) -> int:
    """The cache directory, created (mode 0700) if absent, opened; it must be this user's
    and writable by no one else, as anyone who can write it could replace the library."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise RuntimeError(
            f"fused=True caches its kernel library in {path}, which cannot be created or opened "
            f"({error.strerror}); set FUNCTORCH_OPTIM_CACHE to a directory of yours, or use fused=False"
        ) from None
    st = os.fstat(fd)
    problem = None
    if st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):#o})"
    if problem:
        os.close(fd)
        raise RuntimeError(
            f"the fused-kernel cache directory {path} {problem}: a library there could be "
            "replaced by someone else, so fused=True does not load from it; set "
            f"FUNCTORCH_OPTIM_CACHE to a directory only you can write (or run chmod go-w {path}), "
            "or use fused=False"
        )
    return fd


@contextlib.contextmanager
def _locked(directory: int) -> Iterator[None]:
    """An exclusive lock on the cache directory while a process checks and builds: a
    second process waits and then loads the first one's build instead of compiling too.
    Where the file system has no ``flock``, builders still commit by atomic rename and
    each process loads only bytes it verified or wrote itself."""
    try:
        if fcntl is None:
            raise OSError("no flock")
        fcntl.flock(directory, fcntl.LOCK_EX)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(directory, fcntl.LOCK_UN)


def _build(compiler: str) -> bytes:
    """The kernel library's bytes, compiled in a private temporary directory.

    A build takes seconds: it says so on stderr, and when it is done, rather than wait
    silently.
    """
    print(
        f"functorch_optim: building the fused=True kernels with {Path(compiler).name} "
        f"(once per machine and version; cached in {_cache_dir()}) ...",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / "fused_kernels.so"
        command = [compiler, *_FLAGS, "-w", "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"building the fused kernel failed:\n{' '.join(command)}\n{result.stderr}")
        data = built.read_bytes()
    print(f"functorch_optim: fused kernels built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return data


def _write_new(directory: int, name: str, data: bytes) -> int:
    """``data`` as ``name`` in ``directory``: written to a fresh file (``O_EXCL``, mode
    0644), flushed to disk, then renamed over ``name`` in one step, so a reader sees the
    old file or the whole new one. Returns the new file's descriptor (write-only)."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=directory
    )
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=directory)
        raise
    return fd


def _verified_library(compiler: str, library: Path) -> int:
    """A descriptor of the kernel library at ``library`` whose bytes are verified: the
    cached file if it passes ``_open_verified``, else a fresh build written there (with
    its checksum beside it) and the descriptor of the file this process wrote."""
    directory = _trusted_directory(library.parent)
    try:
        with _locked(directory):
            try:
                return _open_verified(directory, library.name)
            except FileNotFoundError:
                reason = None
            except _Unverified as error:
                reason = str(error)
                warnings.warn(
                    f"the cached fused-kernel library {library}: {reason}; it is not loaded and is rebuilt",
                    RuntimeWarning,
                    stacklevel=2,
                )
            try:
                data = _build(compiler)
                fd = _write_new(directory, library.name, data)
                digest = hashlib.sha256(data).hexdigest().encode()
                os.close(_write_new(directory, library.name + _CHECKSUM, digest))
                os.fsync(directory)
            except (RuntimeError, OSError) as error:
                detail = (
                    str(error) if isinstance(error, RuntimeError) else f"writing {library} failed: {error}"
                )
                if reason is not None:
                    detail = f"the cached kernel library {library}: {reason}; rebuilding it failed: {detail}"
                raise RuntimeError(detail) from error
            return fd
    finally:
        os.close(directory)


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
    load_kernels()  # registers the targets, in a process that unpickled a fused algorithm too
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
        algorithm, fused_step=FusedStep(kernel, algorithm), fused_window=FusedWindow(kernel)
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


@dataclasses.dataclass(frozen=True)
class FusedStep:
    """A fused algorithm's ``Algorithm.fused_step``: ``kernel``, one call per dtype on the
    CPU for the float32/float64 parameters; elsewhere, and for every other parameter,
    ``algorithm``'s jitted per-parameter rule and the mask.

    A value, not a closure: it pickles (a facade with ``fused=True`` does) and two equal
    configurations share one compiled step.
    """

    kernel: Callable[..., list[tuple[jax.Array, dict[str, jax.Array]]]]
    algorithm: Algorithm

    def __call__(
        self, leaves: list[Leaf], hparams_of, static, one: jax.Array
    ) -> list[tuple[jax.Array, dict[str, jax.Array]]]:
        kernel, algorithm = self.kernel, self.algorithm
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


@dataclasses.dataclass(frozen=True)
class FusedWindow:
    """A fused algorithm's ``Algorithm.fused_window``: ``grad_accumulate``'s calls in
    ``kernel`` (a value, like ``FusedStep``)."""

    kernel: Callable[..., list]

    def __call__(
        self, leaves: list[Leaf], window: Window, hparams_of, static, one: jax.Array
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
            for i, result in zip(
                indices, self.kernel(group, hparams_of(group[0][0].dtype), static, one, part)
            ):
                out[i] = result
        return out


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
        -lr_over(lr, bias_correction1, static),
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
    clr = lr_over(lr, 1 + (t - 1) * hp["lr_decay"], static)
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
