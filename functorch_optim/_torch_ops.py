"""torch's CPU tensor ops, emulated one op at a time; shared by every torch-parity rule.

Each op is computed in torch's opmath dtype (float32 for bf16/fp16 parameters, the
parameter's own dtype otherwise) and rounded back to the parameter dtype after each op,
as torch's CPU kernels do: ``c`` casts to opmath, ``r`` rounds back, and ``a`` is the
scalar of torch's ``add`` (tensor + scalar, or ``alpha=``), which torch rounds to the
tensor's dtype first (bf16!), where mul/addcmul/addcdiv/lerp scalars stay in opmath.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._hyperparams import fixed
from functorch_optim._tree import opmath_dtype

Cast = Callable[[Any], jax.Array]


def caster(dtype: Any) -> Cast:
    """``c(x)``: ``x`` in torch's opmath dtype for parameters of ``dtype``.

    A Python-double scalar meets a float32 tensor as float32 in torch; a bf16 tensor is
    computed in float32 and rounded back after each op (``.astype(dtype)``).
    """
    ct = opmath_dtype(dtype)

    def c(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        # already there: skip ``astype``'s no-op (a step over many leaves calls this
        # thousands of times while tracing); a weak type must still become strong
        if x.dtype == ct and not x.weak_type:
            return x
        return x.astype(ct)

    return c


def op_casts(dtype: Any) -> tuple[Cast, Cast, Cast]:
    """``(c, a, r)`` for parameters of ``dtype``: cast to opmath, torch ``add``'s scalar
    (rounded to ``dtype`` first, then opmath), and round an opmath result back to ``dtype``.
    """
    c = caster(dtype)

    def a(x: Any) -> jax.Array:
        return c(jnp.asarray(x).astype(dtype))

    def r(x: jax.Array) -> jax.Array:
        return x.astype(dtype)

    return c, a, r


def signed_grad(grad: jax.Array, dtype: Any, maximize: bool) -> jax.Array:
    """The gradient in the parameter dtype, negated with ``maximize`` (torch's first line)."""
    grad = grad.astype(dtype)
    return -grad if maximize else grad


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x = hi + lo`` exactly, ``hi`` rounded to half the significand's bits (by integer
    ops on the bits, so no multiply XLA could contract), ``lo`` the rest: products of
    the halves of two numbers are exact."""
    info = jnp.finfo(x.dtype)
    low = (info.nmant + 2) // 2  # bits cleared: 27 for float64, 12 for float32
    itype = jnp.int64 if x.dtype == jnp.float64 else jnp.int32
    bits = jax.lax.bitcast_convert_type(x, itype)
    rounded = (bits + (1 << (low - 1))) & ~((1 << low) - 1)
    hi = jax.lax.bitcast_convert_type(rounded.astype(itype), x.dtype)
    return hi, x - hi


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Knuth's TwoSum: ``s = fl(a + b)`` and the exact error ``a + b - s`` (additions
    only: nothing for XLA to contract)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@jax.custom_jvp
def fma(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """``a * b + c`` rounded once, as the fused multiply-adds of torch's CPU kernels
    (``addcmul`` is ``fma(value * t1, t2, self)``, ``lerp`` and ``add(alpha=)`` are FMAs).

    JAX has no FMA primitive. On the CPU, XLA's code generator fuses a multiply whose
    only use is an add into one FMA instruction (it compiles with LLVM's
    ``AllowFPOpFusion=Fast``: "this increases precision"), so where this machine's CPU
    does (``cpu_contracts_fma``, probed once) the CPU program is ``a * b + stored(c)``:
    one instruction, correctly rounded everywhere (``stored`` keeps a product in ``c``
    from being the one fused). Elsewhere (a GPU or TPU, or a CPU without FMA) it is
    computed exactly in the arrays' own dtype: the product as an exact pair (Dekker's
    product of split halves), then ``product + c`` summed with rounding to odd for the
    low part and to nearest at the end (Boldo and Melquiond, "Emulation of FMA and
    correctly rounded sums: proved algorithms using rounding to odd", 2008); where
    ``a * b + c`` is not finite, or ``a * b`` is below 2**-78 (float32; float64: 2**-916)
    in magnitude, that emulation is the plain expression, rounded twice. Outside ``jit``
    too it runs as a compiled program (the same one), never op by op.
    """
    a, b, c = jnp.broadcast_arrays(*(jnp.asarray(x) for x in (a, b, c)))
    return _fma_program(a, b, c)


@functools.partial(jax.jit, inline=True)
def _fma_program(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    # traced once per shape and dtype, its equations inlined where it is called inside a
    # jit; the CPU branch only where this machine's XLA fuses it (a trace-time fact)
    if not cpu_contracts_fma(a.dtype):
        return _fma(a, b, c)
    return jax.lax.platform_dependent(a, b, c, cpu=_contracted_fma, default=_fma)


def _contracted_fma(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """``a * b + c`` as one FMA instruction where XLA's CPU code generator fuses it: the
    product's only use is the add, and ``c`` (through ``stored``'s select) is no
    product the add could fuse instead."""
    return a * b + stored(c)


def cpu_contracts_fma(dtype: Any) -> bool:
    """Whether XLA on this machine's CPU computes ``_contracted_fma`` in ``dtype``
    (float32 or float64) as one rounding in every loop it was probed in: once per dtype,
    on ``(1 + e)**2 - (1 + 2e)`` (``e`` the dtype's epsilon), which is ``e**2`` rounded
    once and 0 rounded twice, over a vector loop and its scalar tail, and over arrays of
    8 and 37 rows of 2 to 16 elements, with the addend (or the product's operand) itself a
    product or a select, as the rules compute it. LLVM may vectorize such short rows
    across rows, and there its x86-64-v4 (AVX-512) code generation has been seen to drop
    the contraction (an AMD EPYC, 2026-12-07: rows of 3 to 8 elements, float32 and
    float64): where any probe is not rounded once, ``fma`` is the exact emulation.
    False for other dtypes, for float64 while it is not enabled, and where JAX has no CPU
    device; False too where XLA may not use FMA instructions (a CPU without them, or
    ``--xla_cpu_max_isa`` below AVX2)."""
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        return False
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        return False
    return _probe_contraction(dtype)


@functools.cache
def _probe_contraction(dtype: np.dtype) -> bool:
    try:
        # this process's own CPU device: in a multi-process run ``jax.devices()[0]`` may be
        # another process's, and a program put there waits for that process to join it
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return False
    eps = np.finfo(dtype).eps
    # a vector loop and a tail, then rows too short for a vector of their own
    shapes = [(67,), (8, 8), *((37, k) for k in (2, 3, 5, 6, 7, 8, 12, 16))]
    a = [np.full(shape, 1 + eps, dtype) for shape in shapes]
    c = [np.full(shape, -(1 + 2 * eps), dtype) for shape in shapes]
    one = np.ones((), dtype)
    # run now, also while a caller's step is being traced (the answer decides its program)
    with jax.transfer_guard("allow"), jax.ensure_compile_time_eval():
        args = jax.device_put((a, c, one), cpu)
        outs = jax.jit(_contraction_probes)(*args)
    return all(bool(np.all(np.asarray(out) == dtype.type(eps) * dtype.type(eps))) for out in outs)


def _contraction_probes(a: list, c: list, one: jax.Array) -> list:
    # ``one`` is 1 at run time (XLA cannot fold the products by it): a plain addend, a
    # product as the addend, a select as the addend, a product as the multiplicand, and
    # a negated one (centered RMSprop's ``square_avg - grad_avg**2``, here -e**2)
    out = []
    for x, z in zip(a, c):
        out += [
            _contracted_fma(x, x, z),
            _contracted_fma(x * one, x, z * one),
            _contracted_fma(x, x, jnp.where(one > 0, z * one, x)),
            _contracted_fma(x, x * one, z),
            -_contracted_fma(-(x * one), x * one, -z),
        ]
    return out


def _fma(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    plain = a * b + c
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    # Dekker: every operation exact, so a contraction by XLA computes the same values
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    th, tl = _two_sum(c, p)
    v, w = _two_sum(tl, e)
    exact = th + _round_to_odd(v, w)
    # exact where every partial product and error term is a normal number (XLA flushes
    # subnormal results to zero): each is a multiple of ulp(a) * ulp(b) >= u**2 * |a * b|
    # (u the unit roundoff), so |a * b| > tiny / u**2 (2**-78 in float32, 2**-916 in
    # float64) suffices; below it the plain expression (the fused kernels do the same)
    info = jnp.finfo(a.dtype)
    tiny = info.tiny / (info.eps / 2) ** 2
    usable = jnp.isfinite(plain) & jnp.isfinite(p) & (jnp.abs(p) > tiny)
    return jnp.where(usable, exact, plain)


def _round_to_odd(v: jax.Array, w: jax.Array) -> jax.Array:
    """``v + w`` (``w`` the exact error of the rounded ``v``, finite ``v``) rounded to odd:
    ``v`` where exact or odd, else its neighbour toward ``v + w`` (one step of the bit
    pattern: up in magnitude where ``w`` has ``v``'s sign, down where not)."""
    itype = jnp.int64 if v.dtype == jnp.float64 else jnp.int32
    bits = jax.lax.bitcast_convert_type(v, itype)
    inexact_even = (w != 0) & ((bits & 1) == 0)
    step = jnp.where((w > 0) == (v > 0), jnp.ones((), itype), -jnp.ones((), itype))
    return jax.lax.bitcast_convert_type(jnp.where(inexact_even, bits + step, bits), v.dtype)


def true_divide(x: jax.Array, divisor: Any) -> jax.Array:
    """torch's ``tensor / other`` for a number, a 0-d tensor or a tensor that broadcasts
    against ``x``: a division, correctly rounded.

    XLA rewrites a division by a broadcast value into a multiplication by its
    reciprocal (``x * (1 / b)``, two roundings: 6.5% of float64 and 44% of float32
    quotients an ulp off). Here the divisor is ``divisor`` where ``x == x`` and 1 where
    ``x`` is NaN (whose quotient is NaN either way): an elementwise select, not a
    broadcast, so XLA keeps the division, fused in the same loop (a compare per element,
    no pass over memory)."""
    d = jnp.asarray(divisor).astype(x.dtype)
    return x / jnp.where(x == x, d, jnp.ones((), x.dtype))


def rdiv(number: Any, tensor: jax.Array) -> jax.Array:
    """torch's ``number / tensor`` (``Tensor.__rtruediv__``): ``tensor.reciprocal() *
    number``, two roundings in the tensor's dtype. The barrier keeps XLA from folding
    the product back into one division (one rounding)."""
    reciprocal = jax.lax.optimization_barrier(1 / tensor)
    return reciprocal * jnp.asarray(number).astype(tensor.dtype)


@fma.defjvp
def _fma_jvp(primals, tangents):
    # the derivative of a * b + c (the bit manipulations have none)
    a, b, c = primals
    da, db, dc = tangents
    return fma(a, b, c), da * b + a * db + dc


def rounded_product(a: jax.Array, b: Any) -> jax.Array:
    """``a * b`` in ``a``'s dtype, rounded before whatever follows: torch rounds every
    tensor op, where XLA on the CPU may contract a product into a following add or
    subtract (one FMA; neither an ``optimization_barrier`` nor a round trip through
    float64 stops it). The product passed through ``stored``'s select, which no
    contraction crosses: a compare per element, where an exact ``fma(a, b, 0)``
    would cost a few times the whole elementwise step (and drop the sign of a zero)."""
    return stored(a * jnp.asarray(b).astype(a.dtype))


def stored(x: jax.Array) -> jax.Array:
    """``x`` as a torch op stores it: rounded, never contracted into what follows.

    XLA on the CPU may fuse a product with a following add or subtract into one FMA
    (one rounding where torch rounds twice). A select stops it: ``x`` where ``x == x``,
    else NaN (the same value for every input), at the cost of a compare, where
    ``rounded_product``'s exact FMA costs a few times the whole elementwise step.
    """
    return jnp.where(x == x, x, jnp.asarray(jnp.nan, x.dtype))


def sign(x: jax.Array) -> jax.Array:
    """torch's ``sign`` on the CPU: like ``jnp.sign``, but 0 for a NaN (``jnp.sign`` gives NaN)."""
    return jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), jnp.sign(x))


def py_max(first: Any, second: Any) -> jax.Array:
    """Python's ``max(first, second)`` on the scalars torch computes in Python floats:
    ``second`` only where it is greater, so a NaN ``second`` gives ``first`` (and a NaN
    ``first`` stays), where ``jnp.maximum`` propagates either NaN."""
    return jnp.where(second > first, second, first)


def py_min(first: Any, second: Any) -> jax.Array:
    """Python's ``min(first, second)``: ``second`` only where it is smaller (see ``py_max``)."""
    return jnp.where(second < first, second, first)


def lerp_formula(start: jax.Array, end: jax.Array, weight: Any) -> jax.Array:
    """torch's CPU ``lerp`` formula (``aten/src/ATen/native/Lerp.h``), on values already in
    the compute dtype: two branches split at ``|weight| < 0.5``, exact at both ends."""
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


def lerp_fma(start: jax.Array, end: jax.Array, weight: Any) -> jax.Array:
    """``lerp_formula`` with each branch one exact fused multiply-add, as torch's CPU
    kernel computes it (``lerp_vec``): ``fma(coeff, diff, base)`` with ``weight`` and
    ``start`` where ``|weight| < 0.5``, else ``weight - 1`` (``-(1 - weight)``, the same
    rounding) and ``end``: one FMA an element, not both branches and a select."""
    diff = end - start
    weight = jnp.asarray(weight, start.dtype)
    small = jnp.abs(weight) < 0.5
    return fma(jnp.where(small, weight, -(1 - weight)), diff, jnp.where(small, start, end))


def lerp(start: jax.Array, end: jax.Array, weight: Any) -> jax.Array:
    """``start.lerp_(end, weight)``: computed in opmath, rounded to ``start``'s dtype."""
    dtype = start.dtype
    c = caster(dtype)
    return lerp_formula(c(start), c(end), c(weight)).astype(dtype)


def decay_square(exp_avg_sq: jax.Array, grad: jax.Array, beta2: Any) -> jax.Array:
    """``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)``, rounded per op:
    the decayed moment, then ``addcmul``'s one rounding (``fma``, not a contraction XLA
    may pick for the decayed moment's product instead)."""
    dtype = exp_avg_sq.dtype
    c = caster(dtype)
    decayed = (c(exp_avg_sq) * c(beta2)).astype(dtype)
    return fma(c(1 - beta2) * c(grad), c(grad), c(decayed)).astype(dtype)


def apply_weight_decay(
    param: jax.Array,
    grad: jax.Array,
    lr: Any,
    weight_decay: Any,
    decoupled: bool,
    static: Mapping[str, Any] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """torch's ``if weight_decay != 0`` block: decoupled ``param.mul_(1 - lr * wd)`` (with
    a tensor lr, ``static["tensor_lr"]``, in its dtype: ``lr_decay_factor``), else
    ``grad = grad.add(param, alpha=wd)`` (nothing where ``static`` fixes weight_decay at
    0: ``Algorithm.fixed_zero``). Returns ``(param, grad)``."""
    dtype = param.dtype
    c = caster(dtype)
    if not decoupled and fixed(static or {}, "weight_decay") == "zero":
        return param, grad
    if decoupled:
        # ``* 1`` is exact; ``mul_`` stores its product (``rounded_product``: XLA would
        # contract it into the update's add in some lanes of a loop and not in others)
        factor = jnp.where(weight_decay != 0, lr_decay_factor(lr, weight_decay, static or {}), 1)
        return rounded_product(c(param), c(factor)).astype(dtype), grad
    coupled = (c(grad) + c(weight_decay) * c(param)).astype(dtype)
    return param, jnp.where(weight_decay != 0, coupled, grad)


def coupled_weight_decay(static: Mapping[str, Any]) -> tuple[str, ...]:
    """``Algorithm.fixed_zero`` of a rule with a ``decoupled_weight_decay`` flag: the L2
    term reads the param in the moment passes; the decoupled factor is one multiply in
    the parameter pass, which reads the param anyway (and keeping it keeps XLA's
    contraction of what follows alike): only the coupled decay is fixed at 0."""
    return () if static["decoupled_weight_decay"] else ("weight_decay",)


def zero_buffers(*names: str) -> Callable[[jax.Array, Mapping[str, Any]], dict[str, jax.Array]]:
    """An ``init_leaf`` whose buffers ``names`` all start as zeros like the parameter
    (torch's ``torch.zeros_like(p, memory_format=torch.preserve_format)``)."""

    def init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
        return {name: jnp.zeros_like(param) for name in names}

    return init_leaf


def torch_lr(lr: Any, static: Mapping[str, Any]) -> tuple[jax.Array, Cast, Callable[[jax.Array], jax.Array]]:
    """``(lr, c, r)`` for torch's scalar arithmetic on the learning rate.

    With a Python-number ``lr`` torch forms ``lr * ratio``, ``1 - lr * weight_decay``,
    ``lr / bias_correction1`` in doubles: the hyperparameter dtype, where ``c`` and ``r``
    change nothing. With a tensor ``lr`` (``static["tensor_lr"]``, the dtype name
    ``_checks.tensor_lr_dtype`` recorded) each is a 0-d tensor op of that dtype: ``lr``
    comes rounded to it (in its opmath dtype), ``c`` brings the other operand (a Python
    double) to the opmath dtype, as torch's CPU kernels take a scalar operand, and ``r``
    rounds a result back to the tensor's dtype. Either way torch then hands the result
    to the parameter's op as a number (``alpha=``, ``value=``, ``mul_`` by a 0-d
    tensor): exactly its value, which the caller casts to the parameter's opmath dtype.
    """
    dtype = static.get("tensor_lr") or jnp.result_type(lr)
    c = caster(dtype)

    def r(x: jax.Array) -> jax.Array:
        return x.astype(dtype)

    return c(jnp.asarray(lr).astype(dtype)), c, r


def lr_over(lr: Any, x: Any, static: Mapping[str, Any]) -> jax.Array:
    """torch's ``lr / x`` for a Python double ``x`` (a bias correction): in doubles, or
    with a tensor lr a 0-d tensor of its dtype (see ``torch_lr``)."""
    t_lr, c, r = torch_lr(lr, static)
    return r(t_lr / c(x))


def decayed_lr(lr: Any, step: jax.Array, lr_decay: Any, static: Mapping[str, Any]) -> jax.Array:
    """Adagrad's ``clr = lr / (1 + (step - 1) * lr_decay)`` from ``step`` as a float:
    torch's Python arithmetic, the product rounded before the add (left to XLA, the two
    were one FMA), then ``lr_over``."""
    return lr_over(lr, 1 + rounded_product(step - 1, lr_decay), static)


def lr_decay_factor(lr: Any, weight_decay: Any, static: Mapping[str, Any]) -> jax.Array:
    """torch's ``1 - lr * weight_decay`` (decoupled decay's factor): the product rounded
    before the subtraction, in doubles or with a tensor lr in its dtype (``torch_lr``)."""
    t_lr, c, r = torch_lr(lr, static)
    return r(1 - c(r(rounded_product(t_lr, c(weight_decay)))))


def step_as_float(step: jax.Array, hp: Mapping[str, Any]) -> jax.Array:
    """The int32 ``step`` as the float torch uses (a double under x64)."""
    return step.astype(jnp.result_type(hp["lr"]))
