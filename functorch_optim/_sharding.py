"""Beyond one device: state shardings (ZeRO-1), sharding-aware init, data-parallel gradients.

JAX's SPMD engine (``jax.jit`` over a ``jax.sharding.Mesh``) needs, for the optimizer
state, a sharding per leaf. Every state in this package — and every optax state — keeps
its per-parameter buffers as subtrees shaped like the params (``TorchState.buffers[name]``,
``GradAccumulateState.acc_grads``, optax's ``mu``/``nu``, ...). ``state_shardings`` finds
those subtrees by their tree structure and gives each buffer its parameter's sharding;
everything else (step counters, hyperparameters, per-parameter scalars) is replicated
on the parameters' mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from functorch_optim._microbatch import microbatch_grad
from functorch_optim._tree import PyTree, check_params, keystr, leaves_with_path


def _param_shardings(params: PyTree, fn: str) -> list[Any]:
    out = []
    for path, leaf in leaves_with_path(params):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            raise ValueError(
                f"{fn}: the parameter at {keystr(path)} carries no sharding "
                f"(got {type(leaf).__name__}); pass jax.Arrays or "
                "jax.ShapeDtypeStruct(shape, dtype, sharding=...)"
            )
        out.append(sharding)
    return out


def _replicated(sharding: Any, fn: str) -> Any:
    """The fully replicated sharding over the devices (and mesh) of ``sharding``."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    if sharding.is_fully_replicated:
        return sharding
    raise ValueError(
        f"{fn}: cannot derive a replicated sharding from {sharding!r}; give the params "
        "NamedShardings (jax.sharding.NamedSharding(mesh, spec))"
    )


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _zero_sharding(shape: tuple[int, ...], sharding: NamedSharding, axis: str) -> NamedSharding | None:
    """``sharding`` with ``axis`` added on the largest evenly divisible dimension, or None."""
    mesh = sharding.mesh
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    if any(axis in _axes(e) for e in spec):
        return sharding  # already sharded over the axis (e.g. FSDP params): nothing to add
    for d in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        existing = _axes(spec[d])
        factor = mesh.shape[axis] * math.prod(mesh.shape[a] for a in existing)
        if shape[d] >= factor and shape[d] % factor == 0:
            new = list(spec)
            new[d] = (*existing, axis) if existing else axis
            return NamedSharding(mesh, PartitionSpec(*new), memory_kind=sharding.memory_kind)
    return None


def _check_zero_axis(axis: str, shardings: list[Any], params: PyTree) -> None:
    for (path, _), sharding in zip(leaves_with_path(params), shardings, strict=True):
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                f"state_shardings: zero_axis={axis!r} needs NamedSharding params, but the "
                f"parameter at {keystr(path)} has {type(sharding).__name__}"
            )
        mesh = sharding.mesh
        if axis not in mesh.axis_names:
            raise ValueError(
                f"state_shardings: zero_axis={axis!r} is not an axis of the mesh of the "
                f"parameter at {keystr(path)}; its axes are {tuple(mesh.axis_names)}"
            )
        kind = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis]
        if kind == jax.sharding.AxisType.Explicit:
            raise ValueError(
                f"state_shardings: zero_axis={axis!r} is an Explicit mesh axis; ZeRO-1 lets "
                "jit's sharding propagation move gradients and parameters between the "
                "sharded state and the replicated params, which needs an Auto axis: build the "
                f"mesh with axis_types=jax.sharding.AxisType.Auto for {axis!r}"
            )


def _shardings_for(abstract_state: PyTree, params: PyTree, zero_axis: str | None, fn: str) -> PyTree:
    p_leaves = jax.tree.leaves(params)
    treedef = jax.tree.structure(params)
    shardings = _param_shardings(params, fn)
    if zero_axis is not None:
        _check_zero_axis(zero_axis, shardings, params)
    default = _replicated(shardings[0], fn)
    sharded = [0]

    def is_params_like(x: Any) -> bool:
        return jax.tree.structure(x) == treedef

    def per_param(leaf: Any, param: Any, sharding: Any) -> Any:
        if tuple(leaf.shape) != tuple(param.shape):
            return _replicated(sharding, fn)  # per-parameter scalars (step counts, flags)
        if zero_axis is None:
            return sharding
        new = _zero_sharding(tuple(leaf.shape), sharding, zero_axis)
        if new is None:
            return sharding  # too small or not divisible: stays as the parameter is
        sharded[0] += 1
        return new

    def node(x: Any) -> Any:
        if is_params_like(x):
            leaves = treedef.flatten_up_to(x)
            return treedef.unflatten(
                [per_param(s, p, sh) for s, p, sh in zip(leaves, p_leaves, shardings, strict=True)]
            )
        return default

    nodes, state_def = jax.tree_util.tree_flatten(abstract_state, is_leaf=is_params_like)
    out = jax.tree_util.tree_unflatten(state_def, [node(x) for x in nodes])
    if zero_axis is not None and sharded[0] == 0:
        sizes = sorted({p.shape for p in p_leaves})
        raise ValueError(
            f"state_shardings: zero_axis={zero_axis!r} shards no state leaf: no parameter-shaped "
            f"buffer has a dimension divisible by the axis size (parameter shapes {sizes}); "
            "the state would silently stay replicated"
        )
    return out


def state_shardings(
    tx: optax.GradientTransformation, params: PyTree, *, zero_axis: str | None = None
) -> PyTree:
    r"""The sharding of every leaf of ``tx``'s state, for ``jax.jit`` in/out shardings.

    Works for every transformation of this package (``TorchState``, ``grad_accumulate``)
    and for optax's: the state is traced with ``jax.eval_shape(tx.init, params)`` (nothing
    is allocated), its subtrees shaped like ``params`` are found by tree structure, and

    * a buffer leaf with its parameter's shape (momentum, Adam moments, the
      accumulator) gets the parameter's sharding;
    * every other leaf (step counters, hyperparameters, per-parameter scalars) is
      replicated over the mesh of the parameters.

    With ``zero_axis`` set, the parameter-shaped buffers are additionally sharded over
    that mesh axis — ZeRO stage 1: parameters and gradients stay as they are (typically
    replicated over the data-parallel axis), each device keeps and updates ``1/n`` of the
    optimizer state, and ``jit`` all-gathers the updated parameters. The axis goes on the
    buffer's largest dimension that it divides evenly (together with any axes already on
    that dimension); ties go to the leading dimension. A buffer with no such dimension —
    a scalar, or every dimension smaller than or not a multiple of the axis size — stays
    sharded as its parameter (replicated over the axis). A buffer whose parameter is
    already sharded over ``zero_axis`` (FSDP) is left as it is.

    Args:
      tx: any optax-compatible transformation.
      params: the parameters, as ``jax.Array``\ s or ``jax.ShapeDtypeStruct``\ s that carry
        shardings (``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``).
      zero_axis: name of a data-parallel mesh axis to shard the optimizer state over;
        default None (state sharded exactly like the params).

    Returns:
      A pytree of ``jax.sharding.Sharding``\ s with the structure of ``tx.init(params)``.

    Raises:
      ValueError: a parameter without sharding (the message names its path); with
        ``zero_axis``: a parameter whose sharding is not a ``NamedSharding``, a mesh
        without that axis, an Explicit axis (ZeRO-1 relies on ``jit``'s propagation),
        or no state leaf that can be sharded over the axis — a requested sharding is
        never silently dropped.

    Examples:
      >>> import jax, jax.numpy as jnp, functorch_optim as fo
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
      >>> params = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=NamedSharding(mesh, P()))}
      >>> sh = fo.state_shardings(fo.sgd(lr=0.1, momentum=0.9), params, zero_axis="data")
      >>> tuple(sh.buffers["momentum_buffer"]["w"].spec), tuple(sh.buffers["step"]["w"].spec)
      (('data', None), ())

    Note:
      optax's ``init`` builds its buffers with ``zeros_like`` (they inherit the params'
      shardings) but puts its counters on the default device; for a state laid out as
      returned here, with or without ZeRO, build it with
      ``jax.jit(tx.init, out_shardings=state_shardings(tx, params, ...))(params)``.
    """
    check_params(params)
    abstract = jax.eval_shape(tx.init, params)
    return _shardings_for(abstract, params, zero_axis, "state_shardings")


def _needs_placement(leaves: list[Any]) -> bool:
    for leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            return False
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            continue
        if isinstance(leaf, jax.ShapeDtypeStruct) or not isinstance(sharding, SingleDeviceSharding):
            return True
    return False


def sharded_init(raw_init: Callable[[PyTree], PyTree]) -> Callable[[PyTree], PyTree]:
    """Wrap an ``init`` so that sharded or abstract params give a state laid out on their mesh.

    Plain single-device params (and tracers, under ``jit`` or ``eval_shape``) go straight
    to ``raw_init``. Params sharded over several devices, or ``ShapeDtypeStruct``\\ s with
    shardings, are initialised by one ``jit`` with ``out_shardings`` from
    ``state_shardings``: every state leaf is created in place with its parameter's
    sharding (counters replicated), nothing is first built on one device.
    """

    def init(params: PyTree) -> PyTree:
        flat, treedef = jax.tree.flatten(params)
        if not _needs_placement(flat):
            return raw_init(params)
        check_params(params)
        shardings = _shardings_for(jax.eval_shape(raw_init, params), params, None, "init")
        is_arg = [not isinstance(leaf, jax.ShapeDtypeStruct) for leaf in flat]

        def build(args):
            it = iter(args)
            return raw_init(
                treedef.unflatten([next(it) if a else leaf for leaf, a in zip(flat, is_arg, strict=True)])
            )

        return jax.jit(build, out_shardings=shardings)(
            [leaf for leaf, a in zip(flat, is_arg, strict=True) if a]
        )

    return init


def data_parallel_grad(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    mesh: jax.sharding.Mesh,
    axis_name: str = "data",
    *,
    micro_batches: int = 1,
) -> Callable[[PyTree, PyTree], tuple[jax.Array, PyTree]]:
    r"""Loss and gradient of a batch sharded over ``axis_name``, accumulated over micro-batches.

    Each device takes its slice of the batch, splits it into ``micro_batches`` equal
    micro-batches, and sums their gradients locally in a ``lax.scan`` (``microbatch_grad``:
    activations of one micro-batch live at a time); the gradients are then averaged across devices with a
    single ``pmean`` — one collective per optimizer step, whatever ``micro_batches`` is.
    For a loss that is a mean over examples, the result equals the gradient of the whole
    batch on one device (up to summation order):

    .. math:: g = \frac{1}{n k}\sum_{d=1}^{n}\sum_{j=1}^{k} \nabla L(\theta; B_{d,j}).

    Args:
      loss_fn: ``(params, batch) -> scalar``, the mean loss of a batch.
      mesh: the device mesh.
      axis_name: the data-parallel mesh axis, default ``"data"``.
      micro_batches: micro-batches per device per step, an integer >= 1, default 1.

    Returns:
      ``fn(params, batch) -> (loss, grads)``, to call inside ``jax.jit``; every leaf of
      ``batch`` is split along its leading dimension, which must be divisible by
      ``mesh.shape[axis_name] * micro_batches``. ``params`` must be replicated over
      ``axis_name``.

    Raises:
      ValueError: ``micro_batches must be an integer >= 1, got …``; an ``axis_name`` not in
        the mesh; (when called) a batch leaf whose leading dimension does not divide.

    Examples:
      >>> import jax, jax.numpy as jnp, functorch_optim as fo
      >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
      >>> loss = lambda p, b: jnp.mean((b * p["w"]) ** 2)
      >>> grad_fn = fo.data_parallel_grad(loss, mesh, micro_batches=2)
      >>> l, g = jax.jit(grad_fn)({"w": jnp.array(1.0)}, jnp.array([1.0, 2.0, 3.0, 4.0]))
      >>> float(l), float(g["w"])
      (7.5, 15.0)
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"axis_name {axis_name!r} is not an axis of the mesh; its axes are {tuple(mesh.axis_names)}"
        )
    k = micro_batches
    n = mesh.shape[axis_name]
    spec = PartitionSpec(axis_name)
    # one device's micro-batches: the same scan as on one device
    local_grad = microbatch_grad(loss_fn, k)

    def local(params, batch):
        # Marked device-varying, the params' cotangents stay local: differentiating
        # replicated (invariant) inputs would psum the gradient of every micro-batch.
        params = jax.lax.pcast(params, axis_name, to="varying")
        loss, grads = local_grad(params, batch)
        return jax.lax.pmean(loss, axis_name), jax.tree.map(lambda g: jax.lax.pmean(g, axis_name), grads)

    def fn(params, batch):
        for path, x in leaves_with_path(batch):
            lead = jnp.shape(x)[0] if jnp.ndim(x) else None
            if lead is None or lead % (n * k):
                raise ValueError(
                    f"data_parallel_grad: the batch leaf at {keystr(path)} has leading dimension "
                    f"{lead}, not divisible by {n} devices x {k} micro-batches = {n * k}"
                )
        pspec = jax.tree.map(lambda _: PartitionSpec(), params)
        bspec = jax.tree.map(lambda _: spec, batch)
        return jax.shard_map(local, mesh=mesh, in_specs=(pspec, bspec), out_specs=(PartitionSpec(), pspec))(
            params, batch
        )

    return fn
