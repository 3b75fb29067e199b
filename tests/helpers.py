"""Shared test utilities: pytree shapes, random gradient streams, torch runners, errors."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Pytree shapes the parity suites run on: nested dicts/lists/tuples and 0-d leaves.
TREE_SHAPES: dict[str, Any] = {
    "single": (5,),
    "nested": {"layer": {"w": (3, 4), "b": (4,)}, "scale": ()},
    "mixed": [(2, 3), ((4,), (1, 2, 2)), {"s": ()}],
}


#: The hyperparameters whose zero-ness a transformation built with a number fixes in its
#: compiled step (``Algorithm.fixed_zero`` / ``fixed_nonzero``): ``set_hparams`` cannot
#: move them across 0, so a transformation shared by several configurations is built with
#: their zero-ness (``zero_ness``) besides the structural flags.
ZERO_NESS = ("weight_decay", "momentum", "dampening")


def zero_ness(config: Any) -> dict[str, float]:
    """``config``'s numbers among ``ZERO_NESS`` as 0.0, or the stand-in 0.5 where nonzero
    (schedules and arrays, which keep the value changeable, are left out)."""
    out = {}
    for k in ZERO_NESS:
        v = config.get(k)
        if isinstance(v, bool | int | float | np.floating | np.integer):
            out[k] = 0.0 if v == 0 else 0.5
    return out


def rmsprop(fused: bool | None = None, **kwargs: Any) -> Any:
    """``functorch_optim.rmsprop(**kwargs)`` with the choice torch's ``fused`` flag makes for
    SGD, Adam, AdamW and Adagrad (``_rmsprop.rmsprop_variant``): RMSprop has no such
    argument, its kernel is its default path."""
    from functorch_optim._rmsprop import rmsprop_variant

    return rmsprop_variant(fused, **kwargs)


def make_tree(shape_tree: Any, rng: np.random.Generator, dtype: Any = np.float64) -> Any:
    """A pytree of random numpy arrays following ``shape_tree`` (tuples of ints are shapes)."""

    def is_shape(x):
        return isinstance(x, tuple) and all(isinstance(i, int) for i in x)

    return jax.tree.map(lambda s: rng.standard_normal(s).astype(dtype), shape_tree, is_leaf=is_shape)


def grad_stream(
    params: Any, steps: int, seed: int, none_every: int = 0, dtype: Any = np.float64
) -> list[Any]:
    """``steps`` random gradient trees like ``params``.

    With ``none_every = k > 0``, leaf ``i`` gets ``None`` on steps where
    ``(step + i) % k == 0`` — so different leaves miss different steps, and the first
    leaf misses step 0 (its first gradient arrives late).
    """
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for t in range(steps):
        gs = []
        for i, p in enumerate(leaves):
            if none_every and (t + i) % none_every == 0:
                gs.append(None)
            else:
                gs.append(rng.standard_normal(np.shape(p)).astype(dtype))
        out.append(treedef.unflatten(gs))
    return out


def rel_err(a: Any, b: Any) -> float:
    """Max over leaves of ``max|a - b| / max(max|b|, tiny)``, in float64."""
    errs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x = np.asarray(x, np.float64)
        y = np.asarray(y, np.float64)
        scale = max(np.max(np.abs(y)) if y.size else 0.0, 1e-300)
        errs.append(float(np.max(np.abs(x - y)) / scale) if x.size else 0.0)
    return max(errs) if errs else 0.0


def to_jax(tree: Any) -> Any:
    return jax.tree.map(jnp.asarray, tree)


def run_torch(
    make_opt: Callable[[Sequence[Any]], Any],
    params: Any,
    grads: Sequence[Any],
    buffer_names: Sequence[str] = (),
    dtype: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Run a torch optimizer on ``params`` (a numpy pytree) over a gradient stream.

    ``None`` gradient leaves are left as ``p.grad = None``. Returns the final params
    and, per name in ``buffer_names``, the buffer tree (``None`` where torch has none).
    """
    import torch

    leaves, treedef = jax.tree.flatten(params)
    tensors = [torch.tensor(np.asarray(p, dtype=dtype) if dtype else np.asarray(p)) for p in leaves]
    for t in tensors:
        t.requires_grad_(True)
    opt = make_opt(tensors)
    for g in grads:
        g_leaves = treedef.flatten_up_to(g)
        for t, gl in zip(tensors, g_leaves):
            t.grad = None if gl is None else torch.tensor(np.asarray(gl, dtype=np.asarray(t.detach()).dtype))
        opt.step()
    final = treedef.unflatten([t.detach().numpy().copy() for t in tensors])
    buffers = {
        name: treedef.unflatten(
            [
                opt.state[t][name].detach().numpy().copy() if name in opt.state.get(t, {}) else None
                for t in tensors
            ]
        )
        for name in buffer_names
    }
    return final, buffers


def run_jitted(tx: Any, params: Any, grads: Sequence[Any]) -> tuple[Any, Any]:
    """``tx`` over a gradient stream, one jitted ``fo.step`` per gradient: ``(params, state)``."""
    import functorch_optim as fo

    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    state = tx.init(params)
    for g in grads:
        params, state = step(params, g, state)
    return params, state


def assert_bitwise_equal(mine: Any, theirs: Any) -> None:
    """Every leaf of ``mine`` equals ``theirs``'s (same structure) bit for bit, in dtype
    and shape too (NaN equals NaN); the message names the first differing path and how
    many elements differ."""
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(mine)[0], jax.tree.leaves(theirs), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        where = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.shape == y.shape, (where, x.dtype, x.shape, y.dtype, y.shape)
        assert np.array_equal(x, y, equal_nan=True), (where, int(np.sum(~((x == y) | (x != x) & (y != y)))))


def numpy_per_leaf(
    params: Any,
    grads: Sequence[Any],
    rule: Callable[[np.ndarray, Any, dict[str, Any], int], np.ndarray],
    init: Callable[[np.ndarray], dict[str, Any]] = lambda p: {},
) -> tuple[Any, list[dict[str, Any]], list[int]]:
    """Walk a gradient stream leaf by leaf in float64, with torch's lazy per-leaf state.

    ``rule(p, g, s, t)`` returns the leaf's new parameter (``p`` float64, ``g`` the raw
    gradient leaf, ``s`` the leaf's state dict from ``init(p)``, updated in place, ``t``
    the leaf's step, 1 on its first gradient). A ``None`` gradient leaf is skipped, step
    included. Returns ``(params, states, steps)``: the final tree and the per-leaf lists.
    """
    leaves, treedef = jax.tree.flatten(params)
    ps = [np.array(p, np.float64) for p in leaves]
    states = [init(p) for p in ps]
    steps = [0] * len(ps)
    for g_tree in grads:
        for i, g in enumerate(treedef.flatten_up_to(g_tree)):
            if g is None:
                continue
            steps[i] += 1
            ps[i] = rule(ps[i], g, states[i], steps[i])
    return treedef.unflatten(ps), states, steps


def leaf_buffers(
    params: Any, states: Sequence[Mapping[str, Any]], names: Mapping[str, str]
) -> dict[str, Any]:
    """``{buffer name: tree like params}`` from ``numpy_per_leaf``'s states (``names``:
    buffer name -> state key)."""
    treedef = jax.tree.structure(params)
    return {name: treedef.unflatten([s[key] for s in states]) for name, key in names.items()}


def entry_text(compiled: Any) -> str:
    """The entry computation of a compiled program's HLO text (its body, without the
    other computations: fusions, loop bodies)."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY ") :]
    return entry[: entry.index("\n}")]


def kernel_table_bytes(compiled: Any) -> int:
    """The bytes of the tables the kernel calls of a compiled program read (each call's
    last operand, ``_fused._call``: a row of scalars and flags per parameter, then the
    async padding), from its HLO: scratch a step holds besides its arrays."""
    total = 0
    for layouts in re.findall(r"custom-call\(.*operand_layout_constraints=\{(.*?)\}\}", entry_text(compiled)):
        bits, dims = re.fullmatch(r"f(\d+)\[([\d,]*)\]\{[\d,]*", layouts.split(", ")[-1]).groups()
        total += int(np.prod([int(d) for d in dims.split(",") if d])) * int(bits) // 8
    return total


class CompileCounter:
    """Counts XLA compilations (jax's backend-compile events) inside a ``with`` block.

    Examples:
      >>> with CompileCounter() as compiled:
      ...     _ = jax.jit(lambda x: x + 1)(jnp.zeros(3))
      >>> compiled.count
      1
    """

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0

    def _listen(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == self.EVENT:
            self.count += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


# Hugging Face transformers' ``get_linear_schedule_with_warmup`` (optimization.py), verbatim:
# the lr_lambda torch users pass to LambdaLR (Python ``if``, ``max``, ``float``).
def _get_linear_schedule_with_warmup_lr_lambda(
    current_step: int, *, num_warmup_steps: int, num_training_steps: int
):
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    return max(
        0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps))
    )


def get_linear_schedule_with_warmup(
    optimizer, num_warmup_steps, num_training_steps, last_epoch=-1, *, LambdaLR
):
    """transformers' function; ``LambdaLR`` is torch's class or ``functorch_optim.optim``'s."""
    import functools

    lr_lambda = functools.partial(
        _get_linear_schedule_with_warmup_lr_lambda,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
    )
    return LambdaLR(optimizer, lr_lambda, last_epoch)


@functools.cache
def torch_float32_sqrt_is_exact() -> bool:
    """Whether torch's float32 ``sqrt`` on this CPU is correctly rounded (as ``jnp.sqrt`` is).

    torch computes it with MKL's vector math, whose float32 ``sqrt`` depends on the CPU it
    dispatches to: correctly rounded on some, within 1 ulp on others (about 20% of inputs
    1 ulp off on an AMD EPYC with AVX-512). Where it is not, the paths whose step scalars
    torch keeps as float32 tensors (``differentiable=True`` Adam and AdamW:
    ``bias_correction2.sqrt()``) cannot be matched bit for bit; their tests then allow one
    float32 ulp in that scalar (``FLOAT32_SQRT_RTOL``)."""
    import torch

    x = np.random.default_rng(0).random(4096, dtype=np.float32) + np.float32(1e-3)
    return bool(np.array_equal(torch.tensor(x).sqrt().numpy(), np.sqrt(x)))


#: what one float32 ulp in a step scalar (relative 2**-24 .. 2**-23 of each update) makes
#: of the params over a few steps, relative: measured 8e-11 .. 4.9e-9
FLOAT32_SQRT_RTOL = 1e-7
