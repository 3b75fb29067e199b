"""Optimizer-step benchmark: functorch_optim next to optax (jit, donated) and torch (foreach, fused).

``python -m functorch_optim bench`` (or ``python benchmarks/bench.py``) times, in one run
and interleaved round-robin so that machine load hits every contender alike (a sample:
the mean of consecutive calls filling ``MIN_SAMPLE_S``):

* **steps**: SGD (momentum 0.9, weight decay 1e-4), Adam and Adagrad, and with default
  arguments besides ``lr`` plain SGD (``sgd_plain``), AdamW and RMSprop, float32, at 1M / 10M / 50M
  parameters in 1 and 200 leaves and at 100 leaves x 1k; functorch_optim
  (``jax.jit(fo.step)``, params and state donated; and, optax's way, ``tx.update`` +
  ``optax.apply_updates``: "fo via update"), optax (jit, donated), torch
  ``foreach=True`` and ``fused=True``; each row also times the in-place bandwidth
  ceiling ``a += s * b`` (JAX, donated, and torch ``add_``) on the same number of
  elements, and reports GB/s and the fraction of that ceiling; the default and the
  jitted rule are also compared with optax rep by rep (``paired_ratio``: the median
  per-rep ratio and a 95 % interval for it);
* **accumulate**: a ``grad_accumulate`` micro-step next to a bare jitted ``acc + g``,
  the same ``acc + g`` through the step's signature (params and state in and out,
  donated: ``passthrough_acc_add``), ``optax.MultiSteps`` and torch's ``grad.add_``, and
  the call that closes a window next
  to a plain step, in three layouts (the tree with the plain rule, the tree and the flat
  layout with ``fused=True``);
* **peak memory** of each jitted step, from XLA's buffer assignment
  (arguments + outputs - aliased + temporaries), in units of the parameters' size;
* **compile**: trace + compile time of the step for 10 / 100 / 1000 leaves (the median
  of ``compile_rounds`` compiles);
* **train**: the whole training step (forward + backward + AdamW) of a 200-leaf MLP and a
  12-layer, 150-leaf transformer, with functorch_optim, optax and torch
  (``functorch_optim._bench_train``); ``--sections train --quick`` runs it alone, small.

Everything runs on JAX's default backend; torch's contenders run on the same device
(CUDA, waited for after each call, when JAX runs on a GPU; left out when torch cannot use
JAX's device), so the same command benchmarks a GPU machine. Adam is taken from
``functorch_optim.adam`` when the package has it; otherwise the Adam rows compare optax
and torch only. Output: markdown tables on stdout, ``--json``
and a matplotlib plot (``--plot``).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import functorch_optim as fo
from functorch_optim._rmsprop import rmsprop_variant

SECTIONS = ("sgd", "adam", "adagrad", "sgd_plain", "adamw", "rmsprop", "accumulate", "compile", "train")
LR, MOMENTUM, WEIGHT_DECAY = 1e-3, 0.9, 1e-4
ADAM_LR = 1e-3
ADAGRAD_LR = 1e-2
#: bytes moved per float32 parameter: read p, g, buf / write p, buf (SGD); read p, g, m, v /
#: write p, m, v (Adam); read p, g, sum / write p, sum (Adagrad); read acc, g / write acc
#: (micro-step); read a, b / write a (ceiling); plain SGD: read p, g / write p; RMSprop:
#: read p, g, square_avg / write p, square_avg.
BYTES_PER_PARAM = {
    "sgd": 20,
    "adam": 28,
    "adagrad": 20,
    "sgd_plain": 12,
    "adamw": 28,
    "rmsprop": 20,
    "micro": 12,
    "ceiling": 12,
}
FULL_CASES = (
    (1_000_000, 1),
    (1_000_000, 200),
    (10_000_000, 1),
    (10_000_000, 200),
    (50_000_000, 1),
    (50_000_000, 200),
    (100_000, 100),
)
QUICK_CASES = ((100_000, 1), (100_000, 20), (10_000, 10))
FULL_COMPILE_LEAVES = (10, 100, 1000)
QUICK_COMPILE_LEAVES = (10, 30)
ACCUMULATE_EVERY = 4
#: A step-time sample lasts at least this long (``time_round_robin``).
MIN_SAMPLE_S = 0.005
#: ``every`` for a window that never closes: every call is a micro-step
NEVER = 2**30


# --------------------------------------------------------------------------- timing


@dataclass
class Contender:
    """One thing to time: ``run()`` does one step and waits for it; ``prepare()`` runs
    untimed before each timed call (e.g. the micro-steps that open a window)."""

    name: str
    run: Callable[[], Any]
    prepare: Callable[[], Any] | None = None
    bytes_per_param: int | None = None
    memory: float | None = None  # peak bytes / parameter bytes
    extra: dict[str, Any] = field(default_factory=dict)


def time_round_robin(
    contenders: Sequence[Contender],
    reps: int,
    warmup: int = 2,
    settle: int = 1,
    min_sample_s: float = 0.0,
) -> dict[str, dict]:
    """Median and spread of each contender's step time, interleaving contenders per rep.

    Each timed call follows ``settle`` untimed calls of the same contender, as a step
    follows its own library's work in a training loop. Timed right after another
    library's step, a step shares the cores with that library's threads, which keep
    spinning a while after their work (torch's OpenMP threads): on 2 cores a fused
    SGD step over 10M parameters took 7.3 ms right after torch's step and 6.0 ms after
    its own (torch's: 5.5 and 6.0 ms).

    A sample is the mean of as many consecutive calls (each waited for) as fill
    ``min_sample_s`` by the last warm-up call's time, at most 64; one for a contender
    with a ``prepare`` (which must precede each call). One call of a sub-millisecond
    step is at the mercy of the machine's hiccups: two copies of one SGD step over 100
    leaves of 1k elements, timed side by side in six runs of 15 samples each, had
    medians up to 12 % apart with single-call samples and up to 4 % with 5 ms samples.
    """
    calls: dict[str, int] = {}
    for c in contenders:
        last = 0.0
        for _ in range(warmup):
            if c.prepare is not None:
                c.prepare()
            t0 = time.perf_counter()
            c.run()
            last = time.perf_counter() - t0
        fill = math.ceil(min_sample_s / last) if last > 0 else 1
        calls[c.name] = 1 if c.prepare is not None else max(1, min(64, fill))
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(reps):
        # a new order every rep, the same in every run: no contender always follows the
        # same neighbour (a rotation of one order keeps every neighbour: the default's
        # column, listed after torch's ceiling, timed 1.42-1.75x the same program listed
        # after a JAX contender, for SGD, Adagrad and plain SGD at 10M in one leaf)
        order = list(contenders)
        random.Random(r).shuffle(order)
        for c in order:
            for _ in range(settle):
                if c.prepare is not None:
                    c.prepare()
                c.run()
            if c.prepare is not None:
                c.prepare()
            n = calls[c.name]
            t0 = time.perf_counter()
            for _ in range(n):
                c.run()
            times[c.name].append((time.perf_counter() - t0) / n)
    out = {}
    for name, samples in times.items():
        ts = sorted(samples)
        med = statistics.median(ts)
        q1, q3 = np.percentile(ts, [25, 75])
        # ``samples_s`` in rep order: the samples of one rep are taken one after another,
        # within a second or a few, under much the same load (``paired_ratio``)
        out[name] = {"median_s": med, "min_s": ts[0], "spread": float((q3 - q1) / med), "samples_s": samples}
    return out


#: The coverage of ``median_interval``'s interval.
CONFIDENCE = 0.95


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free ``confidence`` interval for the median of the distribution
    ``values`` were drawn from (independently): the order statistics ``x(k)`` and
    ``x(n + 1 - k)`` with the largest ``k`` whose coverage, ``1 - 2 P(B < k)`` for ``B``
    binomial(n, 1/2), is at least ``confidence``. None where ``n`` is too small for any
    (fewer than 6 values at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    below = 0.0  # P(B < k), k = 1, 2, ...
    best = None
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2**n
        if 1 - 2 * below < confidence:
            break
        best = k
    if best is None:
        return None
    return xs[best - 1], xs[n - best]


def paired_ratio(timings: dict[str, dict], a: str, b: str) -> dict[str, Any] | None:
    """``a``'s step time over ``b``'s, one ratio per rep (``time_round_robin`` times every
    contender once per rep, one after another): the median ratio and its
    ``median_interval``. A slowdown of the whole machine during a rep (another
    process, memory traffic of a neighbour) moves both samples of the rep, and cancels in
    its ratio, where it moves one median of the two in a ratio of medians. None where
    either has no samples."""
    if a not in timings or b not in timings:
        return None
    ratios = [x / y for x, y in zip(timings[a]["samples_s"], timings[b]["samples_s"], strict=True)]
    interval = median_interval(ratios)
    return {
        "median": statistics.median(ratios),
        "low": None if interval is None else interval[0],
        "high": None if interval is None else interval[1],
        "reps": len(ratios),
    }


def peak_memory_units(compiled: Any, param_bytes: int) -> float | None:
    """Peak memory of a compiled step in units of the parameters' size."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # pragma: no cover - backends without buffer analysis
        return None
    if ma is None:
        return None
    live = (
        ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    )
    return live / param_bytes


# --------------------------------------------------------------------------- trees


def leaf_sizes(n_params: int, n_leaves: int) -> list[int]:
    base, rest = divmod(n_params, n_leaves)
    return [base + (1 if i < rest else 0) for i in range(n_leaves)]


def numpy_leaves(n_params: int, n_leaves: int, seed: int) -> list[np.ndarray]:
    flat = np.random.default_rng(seed).standard_normal(n_params, dtype=np.float32)
    flat *= 0.01
    out, start = [], 0
    for size in leaf_sizes(n_params, n_leaves):
        out.append(flat[start : start + size])
        start += size
    return out


def as_tree(leaves: Sequence[Any]) -> dict[str, Any]:
    return {f"w{i:04d}": leaf for i, leaf in enumerate(leaves)}


def flat_tree(np_leaves: Sequence[np.ndarray]) -> dict[str, jax.Array]:
    """The leaves as ``ravel_by_dtype`` packs float32 params: one buffer."""
    return {"float32": jnp.asarray(np.concatenate(np_leaves))}


def jax_tree(np_leaves: Sequence[np.ndarray]) -> dict[str, jax.Array]:
    # jnp.array copies: every contender owns its buffers (they are donated)
    return as_tree([jnp.array(x) for x in np_leaves])


def wait(outputs: Any) -> None:
    """Wait until the step that produced ``outputs`` has finished.

    Every output of one XLA execution becomes ready at the same moment, so one array
    suffices; ``jax.block_until_ready`` on the whole tree would add a Python walk over
    hundreds of arrays to every many-leaf step (0.3-1 ms at 200 leaves), a cost of the
    measurement, not of the step (torch's steps are synchronous and pay nothing alike).
    """
    jax.tree.leaves(outputs)[0].block_until_ready()


class JaxStepper:
    """A jitted ``(params, grads, state) -> (params, state)`` with params and state donated."""

    def __init__(self, fn: Callable, params: Any, grads: Any, state: Any, param_bytes: int) -> None:
        self.fn = jax.jit(fn, donate_argnums=(0, 2), keep_unused=True)
        self.compiled = self.fn.lower(params, grads, state).compile()
        self.memory = peak_memory_units(self.compiled, param_bytes)
        self.params, self.grads, self.state = params, grads, state

    def __call__(self) -> None:
        self.params, self.state = self.compiled(self.params, self.grads, self.state)
        wait(self.params)


def fo_step_fn(tx: Any) -> Callable:
    return lambda p, g, s: fo.step(tx, p, g, s)


def optax_step_fn(tx: Any) -> Callable:
    def step(p, g, s):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    return step


def optax_sgd() -> optax.GradientTransformation:
    # torch's L2 weight decay added to the gradient, then momentum (the same math from step 2)
    return optax.chain(optax.add_decayed_weights(WEIGHT_DECAY), optax.sgd(LR, momentum=MOMENTUM))


def fo_sgd(fused: bool | None = None) -> Any:
    return fo.sgd(lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, fused=fused)


def fo_adam(fused: bool | None = None) -> Any:
    return fo.adam(lr=ADAM_LR, fused=fused)


def fo_adagrad(fused: bool | None = None) -> Any:
    return fo.adagrad(lr=ADAGRAD_LR, fused=fused)


def fo_sgd_plain(fused: bool | None = None) -> Any:
    # torch's SGD(params, lr): no momentum, no weight decay (every other argument default)
    return fo.sgd(lr=LR, fused=fused)


def fo_adamw(fused: bool | None = None) -> Any:
    # torch's AdamW(params, lr): weight_decay 0.01, its default
    return fo.adamw(lr=ADAM_LR, fused=fused)


def optax_adamw() -> optax.GradientTransformation:
    # optax's default weight decay is 1e-4; torch's (and this package's) 0.01
    return optax.adamw(ADAM_LR, weight_decay=0.01)


def fo_rmsprop(fused: bool | None = None) -> Any:
    # torch's RMSprop(params): every argument default. torch has no fused RMSprop and
    # neither has fo.rmsprop a ``fused`` argument: its kernel is its default path; the
    # other columns take the choices ``fused`` makes for the others (rmsprop_variant)
    return rmsprop_variant(fused)


def optax_rmsprop() -> optax.GradientTransformation:
    # torch's defaults, eps outside the square root as torch adds it: the same update
    return optax.rmsprop(1e-2, decay=0.99, eps=1e-8, eps_in_sqrt=False)


def optax_adagrad() -> optax.GradientTransformation:
    # eps inside the square root (torch: outside): the same memory traffic
    return optax.adagrad(ADAGRAD_LR, initial_accumulator_value=0.0, eps=1e-10)


#: The step sections: functorch_optim's optimizer (takes ``fused``), optax's closest
#: construction, and torch's class with its arguments.
STEP_KINDS: dict[str, tuple[Callable[..., Any], Callable[[], Any], str, dict[str, float]]] = {
    "sgd": (fo_sgd, optax_sgd, "SGD", {"lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY}),
    "adam": (fo_adam, lambda: optax.adam(ADAM_LR), "Adam", {"lr": ADAM_LR}),
    "adagrad": (fo_adagrad, optax_adagrad, "Adagrad", {"lr": ADAGRAD_LR}),
    # default arguments besides lr: what a port of ``SGD(params, lr)`` / ``AdamW(params, lr)`` runs
    "sgd_plain": (fo_sgd_plain, lambda: optax.sgd(LR), "SGD", {"lr": LR}),
    "adamw": (fo_adamw, optax_adamw, "AdamW", {"lr": ADAM_LR}),
    "rmsprop": (fo_rmsprop, optax_rmsprop, "RMSprop", {}),
}


def jax_contender(
    name: str, fn: Callable, tx_init: Callable, np_leaves, grads, nbytes: int, kind: str, pack=jax_tree
):
    params = pack(np_leaves)
    stepper = JaxStepper(fn, params, grads, tx_init(params), nbytes)
    return Contender(name, stepper, bytes_per_param=BYTES_PER_PARAM[kind], memory=stepper.memory)


def ceiling_contenders(n_params: int, torch: TorchSide | None) -> list[Contender]:
    """``a += s * b`` in place on ``n_params`` float32 elements: JAX (donated) and torch."""
    a = {"a": jnp.full((n_params,), 0.5, jnp.float32)}
    b = jnp.full((n_params,), 0.25, jnp.float32)
    axpy = jax.jit(lambda a, b: a + 1e-3 * b, donate_argnums=0)

    def run_jax():
        a["a"] = axpy(a["a"], b)
        a["a"].block_until_ready()

    out = [Contender("ceiling jax", run_jax, bytes_per_param=BYTES_PER_PARAM["ceiling"])]
    if torch is not None:
        ta, tb = torch.full(n_params, 0.5), torch.full(n_params, 0.25)
        out.append(
            Contender(
                "ceiling torch",
                torch.timed(lambda: ta.add_(tb, alpha=1e-3)),
                bytes_per_param=BYTES_PER_PARAM["ceiling"],
            )
        )
    return out


def torch_contenders(kind: str, np_leaves, np_grads, torch: TorchSide | None) -> list[Contender]:
    if torch is None:
        return []
    out = []
    grads = [torch.tensor(g) for g in np_grads]  # shared, read-only for both optimizers
    for flavour in ("foreach", "fused"):
        params = [torch.tensor(x) for x in np_leaves]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        flags = {"foreach": True} if flavour == "foreach" else {"fused": True}
        _, _, name, kwargs = STEP_KINDS[kind]
        cls = getattr(torch.torch.optim, name)
        if flavour == "fused" and "fused" not in inspect.signature(cls).parameters:
            continue  # torch has no fused kernel for it (RMSprop)
        opt = cls(params, **kwargs, **flags)
        out.append(
            Contender(f"torch {flavour}", torch.timed(opt.step), bytes_per_param=BYTES_PER_PARAM[kind])
        )
    return out


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class TorchSide:
    """torch on the device JAX steps on: CUDA when JAX's default backend is a GPU (and
    torch has CUDA), else the CPU. ``timed(fn)`` is ``fn`` followed by waiting for the
    device, so that a CUDA step is timed to its end as a JAX step is."""

    torch: Any
    device: str

    def tensor(self, x: Any) -> Any:
        return self.torch.as_tensor(x, device=self.device).clone()

    def full(self, n: int, value: float) -> Any:
        return self.torch.full((n,), value, device=self.device)

    def timed(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        if self.device == "cpu":
            return fn
        sync = self.torch.cuda.synchronize

        def run() -> None:
            fn()
            sync()

        return run


def _torch() -> TorchSide | None:
    try:
        import torch
    except ImportError:  # torch is an optional extra
        return None
    if jax.default_backend() == "cpu":
        return TorchSide(torch, "cpu")
    if jax.default_backend() == "gpu" and torch.cuda.is_available():
        return TorchSide(torch, "cuda")
    return None  # JAX on an accelerator torch cannot use: no like-for-like torch rows


def _summarise(contenders, timings, n_params, kind) -> dict[str, Any]:
    row: dict[str, Any] = {"times_ms": {}, "gbps": {}, "memory_x_params": {}, "spread": {}}
    for c in contenders:
        t = timings[c.name]["median_s"]
        row["times_ms"][c.name] = t * 1e3
        row["spread"][c.name] = timings[c.name]["spread"]
        if c.bytes_per_param is not None:
            row["gbps"][c.name] = c.bytes_per_param * n_params / t / 1e9
        if c.memory is not None:
            row["memory_x_params"][c.name] = c.memory
    ceil = [v for k, v in row["gbps"].items() if k.startswith("ceiling")]
    row["ceiling_gbps"] = max(ceil)
    row["fraction_of_ceiling"] = {
        k: v / row["ceiling_gbps"] for k, v in row["gbps"].items() if not k.startswith("ceiling")
    }
    return row


def _ratio(times: dict[str, float], a: str, b: str) -> float | None:
    if a in times and b in times:
        return times[a] / times[b]
    return None


def bench_steps(
    kind: str, cases, reps: int, log: Callable[[str], None], settle: int = 1
) -> list[dict[str, Any]]:
    torch = _torch()
    rows = []
    for n_params, n_leaves in cases:
        log(f"{kind}: {n_params:,} params in {n_leaves} leaves")
        np_leaves = numpy_leaves(n_params, n_leaves, seed=0)
        np_grads = numpy_leaves(n_params, n_leaves, seed=1)
        grads = jax_tree(np_grads)
        nbytes = 4 * n_params
        contenders = ceiling_contenders(n_params, torch)
        make, make_optax, _, _ = STEP_KINDS[kind]
        fo_tx, opt_tx = make(), make_optax()
        # the default (fused=None: the kernel where it applies), the kernel forced, and the
        # jitted rule forced (what runs on a GPU or TPU)
        fused_tx = make(fused=True)
        named = [("functorch_optim", fo_tx), ("fo fused", fused_tx), ("fo fused=False", make(fused=False))]
        for name, tx in named:
            contenders.append(jax_contender(name, fo_step_fn(tx), tx.init, np_leaves, grads, nbytes, kind))
        # the default the way optax's users call it: update, then optax.apply_updates
        contenders.append(
            jax_contender("fo via update", optax_step_fn(fo_tx), fo_tx.init, np_leaves, grads, nbytes, kind)
        )
        contenders.append(
            jax_contender("optax", optax_step_fn(opt_tx), opt_tx.init, np_leaves, grads, nbytes, kind)
        )
        if n_leaves > 1:
            # the fused step on the flat layout: one buffer for all leaves (ravel_by_dtype)
            flat_grads = flat_tree(np_grads)
            contenders.append(
                jax_contender(
                    "fo flat",
                    fo_step_fn(fused_tx),
                    fused_tx.init,
                    np_leaves,
                    flat_grads,
                    nbytes,
                    kind,
                    flat_tree,
                )
            )
        contenders += torch_contenders(kind, np_leaves, np_grads, torch)
        timings = time_round_robin(contenders, reps, settle=settle, min_sample_s=MIN_SAMPLE_S)
        row = {
            "algorithm": kind,
            "params": n_params,
            "leaves": n_leaves,
            **_summarise(contenders, timings, n_params, kind),
        }
        t = row["times_ms"]
        row["ratios"] = {
            "fo/torch fused": _ratio(t, "functorch_optim", "torch fused"),
            "fo/optax": _ratio(t, "functorch_optim", "optax"),
            "fo via update/optax": _ratio(t, "fo via update", "optax"),
            "fo/torch foreach": _ratio(t, "functorch_optim", "torch foreach"),
            "optax/torch fused": _ratio(t, "optax", "torch fused"),
            "fo flat/torch fused": _ratio(t, "fo flat", "torch fused"),
            "fo fused/torch fused": _ratio(t, "fo fused", "torch fused"),
            "fo fused/optax": _ratio(t, "fo fused", "optax"),
            "fo fused=False/optax": _ratio(t, "fo fused=False", "optax"),
            "fo fused=False/torch fused": _ratio(t, "fo fused=False", "torch fused"),
        }
        row["paired"] = {
            "fo/optax": paired_ratio(timings, "functorch_optim", "optax"),
            "fo via update/optax": paired_ratio(timings, "fo via update", "optax"),
            "fo fused=False/optax": paired_ratio(timings, "fo fused=False", "optax"),
        }
        rows.append(row)
        del contenders, grads
        gc.collect()
    return rows


#: grad_accumulate's layouts: (name in the targets, contender prefix, its bare ``acc + g``,
#: packer, fused=True). The tree with fused=True shares the tree's bare ``acc + g``.
ACCUMULATE_LAYOUTS = (
    ("tree", "fo", "bare acc+g", jax_tree, False),
    ("tree, fused=True", "fo fused", "bare acc+g", jax_tree, True),
    ("flat, fused=True", "fo flat", "bare flat acc+g", flat_tree, True),
)


def bench_accumulate(cases, reps: int, log: Callable[[str], None], settle: int = 1) -> list[dict[str, Any]]:
    torch = _torch()
    rows = []
    for n_params, n_leaves in cases:
        log(f"accumulate: {n_params:,} params in {n_leaves} leaves")
        np_leaves = numpy_leaves(n_params, n_leaves, seed=0)
        np_grads = numpy_leaves(n_params, n_leaves, seed=1)
        grads = jax_tree(np_grads)
        nbytes = 4 * n_params
        contenders = ceiling_contenders(n_params, torch)
        bares = set()
        for _, prefix, bare, pack, fused in ACCUMULATE_LAYOUTS:
            contenders += accumulate_contenders(
                prefix,
                bare if bare not in bares else None,
                pack,
                np_leaves,
                np_grads,
                fo_sgd(fused=fused),
                nbytes,
            )
            bares.add(bare)
        multi = optax.MultiSteps(optax_sgd(), every_k_schedule=NEVER)
        contenders.append(
            jax_contender(
                "optax MultiSteps micro-step",
                optax_step_fn(multi),
                multi.init,
                np_leaves,
                grads,
                nbytes,
                "micro",
            )
        )
        if torch is not None:
            t_acc = [torch.tensor(np.zeros_like(x)) for x in np_leaves]
            t_grads = [torch.tensor(g) for g in np_grads]
            add_ = lambda t_acc=t_acc, t_grads=t_grads: torch.torch._foreach_add_(t_acc, t_grads)
            contenders.append(
                Contender("torch grad.add_", torch.timed(add_), bytes_per_param=BYTES_PER_PARAM["micro"])
            )
        timings = time_round_robin(contenders, reps, settle=settle, min_sample_s=MIN_SAMPLE_S)
        row = {
            "algorithm": "grad_accumulate(sgd)",
            "params": n_params,
            "leaves": n_leaves,
            **_summarise(contenders, timings, n_params, "micro"),
        }
        t = row["times_ms"]
        row["ratios"] = {}
        for _, prefix, bare, _, _ in ACCUMULATE_LAYOUTS:
            micro, window, plain = (f"{prefix} {k} step" for k in ("micro", "window", "plain"))
            row["ratios"] |= {
                f"{prefix} micro/bare": _ratio(t, micro, bare),
                f"{prefix} micro/passthrough": _ratio(t, micro, f"{prefix} passthrough acc+g"),
                f"{prefix} weighted micro/bare": _ratio(
                    t, f"{prefix} weighted micro step", bare.replace("acc+g", "acc+w*g")
                ),
                f"MultiSteps micro/{prefix} micro": _ratio(t, "optax MultiSteps micro-step", micro),
                f"{prefix} window/plain": _ratio(t, window, plain),
                # what closing a window adds to the optimizer step itself: the window step
                # is a micro-step (adding the last gradient in) and the step on the mean
                f"{prefix} (window - micro)/plain": (t[window] - t[micro]) / t[plain],
            }
        rows.append(row)
        del contenders, grads
        gc.collect()
    return rows


def passthrough_acc_add(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
    """``(params, grads, state) -> (params, state)`` of a ``grad_accumulate`` state with
    only the gradient added into its accumulator: a micro-step's signature, none of its
    decisions (the bench's floor for a micro-step)."""
    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), state.acc_grads, grads)
    return params, state._replace(acc_grads=acc)


def accumulate_contenders(
    prefix: str,
    bare: str | None,
    pack: Callable[[Sequence[np.ndarray]], Any],
    np_leaves,
    np_grads,
    sgd: Any,
    nbytes: int,
) -> list[Contender]:
    """grad_accumulate(``sgd``) with the arrays laid out by ``pack`` (``jax_tree`` or
    ``flat_tree``): its micro-step, the call that closes a window of 2 (after an untimed
    micro-step) and the plain step, named ``"{prefix} micro step"`` and so on, and
    ``passthrough_acc_add`` over the same arrays (``"{prefix} passthrough acc+g"``); and, named
    ``bare`` unless None, a bare jitted ``acc + g`` on the same arrays."""
    grads = pack(np_grads)

    def stepper(tx: Any) -> JaxStepper:
        params = pack(np_leaves)  # each contender owns (and donates) its own
        return JaxStepper(fo_step_fn(tx), params, grads, tx.init(params), nbytes)

    micro_tx = fo.grad_accumulate(sgd, every=NEVER)
    micro = stepper(micro_tx)
    window = stepper(fo.grad_accumulate(sgd, every=2))
    plain = stepper(sgd)
    # reduction="weighted": the weight is an argument (traced), as a training loop passes it
    weighted_tx = fo.grad_accumulate(sgd, every=NEVER, reduction="weighted")
    params = pack(np_leaves)
    weighted = JaxStepper(
        lambda p, gw, s: fo.step(weighted_tx, p, gw[0], s, weight=gw[1]),
        params,
        (grads, jnp.float32(37.0)),
        weighted_tx.init(params),
        nbytes,
    )
    # the least any micro-step through ``fo.step``'s signature costs: the same arrays in
    # and out (params and state donated), only ``acc + g`` computed; what it takes above
    # ``bare`` is the dispatch of the arrays the step carries (params, buffers), not work
    params = pack(np_leaves)
    passthrough = JaxStepper(passthrough_acc_add, params, grads, micro_tx.init(params), nbytes)
    micro_bytes, step_bytes = BYTES_PER_PARAM["micro"], BYTES_PER_PARAM["sgd"]
    out = [
        Contender(f"{prefix} micro step", micro, bytes_per_param=micro_bytes, memory=micro.memory),
        Contender(
            f"{prefix} passthrough acc+g", passthrough, bytes_per_param=micro_bytes, memory=passthrough.memory
        ),
        Contender(
            f"{prefix} weighted micro step", weighted, bytes_per_param=micro_bytes, memory=weighted.memory
        ),
        Contender(
            f"{prefix} window step", window, prepare=window, bytes_per_param=step_bytes, memory=window.memory
        ),
        Contender(f"{prefix} plain step", plain, bytes_per_param=step_bytes, memory=plain.memory),
    ]
    if bare is not None:
        acc = {"acc": jax.tree.map(jnp.zeros_like, pack(np_leaves))}
        add = jax.jit(lambda a, g: jax.tree.map(jnp.add, a, g), donate_argnums=0)
        add = add.lower(acc["acc"], grads).compile()

        def run_add() -> None:
            acc["acc"] = add(acc["acc"], grads)
            wait(acc["acc"])

        w_acc = {"acc": jax.tree.map(jnp.zeros_like, pack(np_leaves))}
        add_w = jax.jit(lambda a, g, w: jax.tree.map(lambda a, g: a + w * g, a, g), donate_argnums=0)
        add_w = add_w.lower(w_acc["acc"], grads, jnp.float32(37.0)).compile()

        def run_add_w() -> None:
            w_acc["acc"] = add_w(w_acc["acc"], grads, jnp.float32(37.0))
            wait(w_acc["acc"])

        out.append(
            Contender(bare, run_add, bytes_per_param=micro_bytes, memory=peak_memory_units(add, nbytes))
        )
        out.append(
            Contender(
                bare.replace("acc+g", "acc+w*g"),
                run_add_w,
                bytes_per_param=micro_bytes,
                memory=peak_memory_units(add_w, nbytes),
            )
        )
    return out


#: The compile section's default-argument rows: name -> (functorch_optim's optimizer,
#: optax's closest construction).
DEFAULT_COMPILE_PAIRS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "sgd default": (lambda: fo.sgd(lr=LR), lambda: optax.sgd(LR)),
    "adamw default": (lambda: fo.adamw(lr=ADAM_LR), lambda: optax.adamw(ADAM_LR, weight_decay=1e-2)),
    "adagrad default": (lambda: fo.adagrad(lr=ADAGRAD_LR), optax_adagrad),
    "rmsprop default": (lambda: fo.rmsprop(lr=1e-2), lambda: optax.rmsprop(1e-2, decay=0.99, eps=1e-8)),
}


def cold_compile_seconds(jitted: Callable[[], Any]) -> float:
    """Seconds to trace, lower and compile ``jitted()`` (a ``jit(...).lower(...).compile()``)
    as the first compile of its program in a process: JAX's in-memory caches are cleared
    first, so no trace, nested ``jit`` (this package's per-shape rule, ``_staged_rule``) or
    lowering that an earlier round or row cached is reused (a later round of one
    contender would otherwise be timed partly warm, and one library more than another).
    What a process does once whatever it compiles (LLVM's set-up, this package's FMA
    probe) stays done: the sections time a warm-up round first and discard it."""
    jax.clear_caches()
    t0 = time.perf_counter()
    jitted()
    return time.perf_counter() - t0


def compile_seconds(
    compilers: dict[str, Callable[[], Any]], rounds: int, warmup: bool = True
) -> dict[str, float]:
    """Per name, the median seconds of ``rounds`` cold compiles (``cold_compile_seconds``),
    the names interleaved round by round, after one discarded warm-up compile of each
    (``warmup``). A single compile per contender, the first of them paying what a process
    does once, had one program at 2.75 s as the first contender of the whole-step
    section and 2.08 s as the third (run ``i``, the MLP)."""
    if warmup:
        for compile_fn in compilers.values():
            compile_fn()
    samples: dict[str, list[float]] = {name: [] for name in compilers}
    for _ in range(rounds):
        for name, compile_fn in compilers.items():
            samples[name].append(cold_compile_seconds(compile_fn))
    return {name: statistics.median(ts) for name, ts in samples.items()}


def _step_compiler(fn: Callable, *args: Any) -> Callable[[], Any]:
    """The compile of ``fn`` jitted as the bench's steps are (params and state donated)."""
    return lambda: jax.jit(fn, donate_argnums=(0, 2), keep_unused=True).lower(*args).compile()


def compile_rounds(n_leaves: int) -> int:
    """Compilations per contender at ``n_leaves`` (their median is reported): one
    compile of a 100-leaf step takes ~0.1 s and varied by up to 25 % between
    compiles of one program here; one of 1000 leaves takes seconds and varies less."""
    return 5 if n_leaves <= 100 else 1


def bench_compile(leaf_counts, log: Callable[[str], None], leaf_size: int = 1000) -> list[dict[str, Any]]:
    rows = []
    # a warm-up round over 2 leaves, discarded: the process's one-time costs land on no
    # contender (each compile after it is cold: ``cold_compile_seconds``)
    warm = as_tree([jnp.zeros((leaf_size,), jnp.float32) for _ in range(2)])
    for compile_fn in _compilers(warm, warm).values():
        compile_fn()
    for n_leaves in leaf_counts:
        rounds = compile_rounds(n_leaves)
        log(f"compile: {n_leaves} leaves of {leaf_size}, median of {rounds}")
        params = as_tree([jnp.zeros((leaf_size,), jnp.float32) for _ in range(n_leaves)])
        s = compile_seconds(_compilers(params, params), rounds, warmup=False)
        row: dict[str, Any] = {"leaves": n_leaves, "leaf_size": leaf_size, "rounds": rounds, "seconds": s}
        row["ratios"] = {
            "fo sgd/optax sgd": _ratio(s, "fo sgd", "optax sgd"),
            "fo grad_accumulate/optax MultiSteps": _ratio(s, "fo grad_accumulate", "optax MultiSteps"),
            "fo grad_accumulate fused/optax MultiSteps": _ratio(
                s, "fo grad_accumulate fused", "optax MultiSteps"
            ),
            "fo adam/optax adam": _ratio(s, "fo adam", "optax adam"),
            **{f"fo {k}/optax {k}": _ratio(s, f"fo {k}", f"optax {k}") for k in DEFAULT_COMPILE_PAIRS},
            "fo sgd flat/optax sgd": _ratio(s, "fo sgd flat", "optax sgd"),
            "fo sgd fused/optax sgd": _ratio(s, "fo sgd fused", "optax sgd"),
            "fo adam flat/optax adam": _ratio(s, "fo adam flat", "optax adam"),
            "fo grad_accumulate flat/optax MultiSteps": _ratio(
                s, "fo grad_accumulate flat", "optax MultiSteps"
            ),
        }
        rows.append(row)
        gc.collect()
    return rows


def _compilers(params: Any, grads: Any) -> dict[str, Callable[[], Any]]:
    """Each compile-section contender's compile (trace, lower, XLA) over ``params``."""
    candidates: dict[str, tuple[Any, Callable]] = {
        "fo sgd": (fo_sgd(), fo_step_fn),
        "optax sgd": (optax_sgd(), optax_step_fn),
        "fo grad_accumulate": (fo.grad_accumulate(fo_sgd(), every=ACCUMULATE_EVERY), fo_step_fn),
        "optax MultiSteps": (
            optax.MultiSteps(optax_sgd(), every_k_schedule=ACCUMULATE_EVERY),
            optax_step_fn,
        ),
    }
    candidates["fo sgd fused"] = (fo_sgd(fused=True), fo_step_fn)
    candidates["fo grad_accumulate fused"] = (
        fo.grad_accumulate(fo_sgd(fused=True), every=ACCUMULATE_EVERY),
        fo_step_fn,
    )
    candidates["fo adam"] = (fo_adam(), fo_step_fn)
    candidates["fo adam fused"] = (fo_adam(fused=True), fo_step_fn)
    candidates["optax adam"] = (optax.adam(ADAM_LR), optax_step_fn)
    # default arguments (besides lr), each against optax's closest construction
    for name, (fo_tx, optax_tx) in DEFAULT_COMPILE_PAIRS.items():
        candidates[f"fo {name}"] = (fo_tx(), fo_step_fn)
        candidates[f"optax {name}"] = (optax_tx(), optax_step_fn)
    compilers = {
        name: _step_compiler(make(tx), params, grads, tx.init(params))
        for name, (tx, make) in candidates.items()
    }
    # the flat layout: the step sees one buffer whatever the number of leaves
    flat, _ = fo.ravel_by_dtype(params)
    for name, tx in (
        ("fo sgd flat", fo_sgd()),
        ("fo adam flat", fo_adam()),
        ("fo grad_accumulate flat", fo.grad_accumulate(fo_sgd(), every=ACCUMULATE_EVERY)),
    ):
        compilers[name] = _step_compiler(fo_step_fn(tx), flat, flat, tx.init(flat))
    return compilers


# --------------------------------------------------------------------------- targets


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The speed targets checked on ``result``, per layout: each entry is the worst value
    over the rows the target covers, the case it came from, the limit and whether it holds.

    Layouts: "tree" is a pytree of leaves as given; "flat" is ``ravel_by_dtype``'s one
    buffer per dtype (only timed where there is more than one leaf; a one-leaf tree is
    already flat, so "best" takes the tree's fused step there).
    """
    out: list[dict[str, Any]] = []

    def add(target: str, layout: str, cases: list[tuple[str, float | None]], limit: float, at_most=True):
        cases = [(c, v) for c, v in cases if v is not None and math.isfinite(v)]
        if not cases:
            return
        case, worst = (max if at_most else min)(cases, key=lambda cv: cv[1])
        holds = worst <= limit if at_most else worst >= limit
        limit_text = f"{'≤' if at_most else '≥'} {limit:g}"
        out.append(
            {
                "target": target,
                "layout": layout,
                "worst": worst,
                "case": case,
                "limit": limit_text,
                "holds": holds,
            }
        )

    label = lambda r: f"{r.get('algorithm', '')} {_size(r['params'])}×{r['leaves']}".strip()
    big = [r for k in ("sgd", "adam") for r in result.get(k, []) if r["params"] >= 10_000_000]
    best = lambda r: "fo fused" if r["leaves"] == 1 else "fo flat"
    t = lambda r, name: r["times_ms"].get(name)
    ratio = lambda r, a, b: (t(r, a) / t(r, b)) if t(r, a) and t(r, b) else None
    steps = [r for k in STEP_KINDS for r in result.get(k, [])]
    # (results written before RMSprop had a kernel have no fused=False column for it: its
    # default was the rule)
    rule = lambda r: "fo fused=False" if "fo fused=False" in r["times_ms"] else "functorch_optim"
    # (``add`` skips a layout no row has: results from before its contender existed)
    for layout, pick in (
        ("tree, default", lambda r: "functorch_optim"),
        ("tree, default via update", lambda r: "fo via update"),
        ("tree, fused=False", rule),
    ):
        add(
            "0. step / optax (every step row)",
            layout,
            [(label(r), ratio(r, pick(r), "optax")) for r in steps],
            1.0,
        )
    # the same comparison against the noise: the lower end of each row's interval for its
    # per-rep ratio (``paired_ratio``); above 1, the row is slower beyond the spread
    for layout, key in (
        ("tree, default", "fo/optax"),
        ("tree, default via update", "fo via update/optax"),
        ("tree, fused=False", "fo fused=False/optax"),
    ):
        rows = [(label(r), (r.get("paired", {}).get(key) or {}).get("low")) for r in steps]
        add(
            f"0. step / optax, paired per rep: low end of the {CONFIDENCE:.0%} interval",
            layout,
            rows,
            1.0,
        )
    for layout, pick in (
        ("tree, fused=True", lambda r: "fo fused"),
        ("best: flat if > 1 leaf, fused=True", best),
    ):
        add(
            "1. step / torch fused=True (10M, 50M)",
            layout,
            [(label(r), ratio(r, pick(r), "torch fused")) for r in big],
            1.1,
        )
        add(
            "1. % of the in-place ceiling (10M, 50M)",
            layout,
            [(label(r), 100 * r["fraction_of_ceiling"].get(pick(r), math.nan)) for r in big],
            85,
            at_most=False,
        )
        add(
            "1. optax / step (10M, 50M)",
            layout,
            [(label(r), ratio(r, "optax", pick(r))) for r in big],
            1.4,
            at_most=False,
        )
    acc = result.get("accumulate", [])
    for layout, prefix, bare, _, _ in ACCUMULATE_LAYOUTS:
        micro, window, plain = (f"{prefix} {k} step" for k in ("micro", "window", "plain"))
        add("2. micro-step / bare acc + g", layout, [(label(r), ratio(r, micro, bare)) for r in acc], 1.1)
        add(
            "2. micro-step / passthrough acc + g",
            layout,
            [(label(r), ratio(r, micro, f"{prefix} passthrough acc+g")) for r in acc],
            1.1,
        )
        add(
            "2. MultiSteps micro-step / micro-step",
            layout,
            [(label(r), ratio(r, "optax MultiSteps micro-step", micro)) for r in acc],
            5,
            at_most=False,
        )
        add(
            "2. (window step − micro-step) / plain step",
            layout,
            [(label(r), r["ratios"].get(f"{prefix} (window - micro)/plain")) for r in acc],
            1.0,
        )
        add("2. window step / plain step", layout, [(label(r), ratio(r, window, plain)) for r in acc], 1.0)
        add(
            "2. peak memory of micro and window steps ×P",
            layout,
            [
                (f"{label(r)} {k}", r["memory_x_params"].get(f"{prefix} {k} step"))
                for r in acc
                for k in ("micro", "window")
            ],
            4.0 + 0.05,  # params + grads + momentum + accumulator, plus scalars
        )
    comp = result.get("compile", [])
    if comp:
        r = max(comp, key=lambda r: r["leaves"])
        s, n = r["seconds"], f"{r['leaves']} leaves"
        c = lambda a, b: (s[a] / s[b]) if a in s and b in s else None
        for target, layout, a, b in (
            ("3. compile SGD step / optax", "tree", "fo sgd", "optax sgd"),
            ("3. compile SGD step / optax", "tree, fused=True", "fo sgd fused", "optax sgd"),
            ("3. compile SGD step / optax", "flat", "fo sgd flat", "optax sgd"),
            ("3. compile Adam step / optax", "tree", "fo adam", "optax adam"),
            ("3. compile Adam step / optax", "flat", "fo adam flat", "optax adam"),
            *(
                (f"3. compile {k} step / optax", "tree", f"fo {k}", f"optax {k}")
                for k in DEFAULT_COMPILE_PAIRS
            ),
            ("3. compile grad_accumulate / MultiSteps", "tree", "fo grad_accumulate", "optax MultiSteps"),
            (
                "3. compile grad_accumulate / MultiSteps",
                "tree, fused=True",
                "fo grad_accumulate fused",
                "optax MultiSteps",
            ),
            (
                "3. compile grad_accumulate / MultiSteps",
                "flat",
                "fo grad_accumulate flat",
                "optax MultiSteps",
            ),
        ):
            add(target, layout, [(n, c(a, b))], 0.5)
        # the step, default arguments and the benchmark's, in the tree layout: at most
        # optax's at 100 leaves and more
        pairs = [("sgd", "fo sgd", "optax sgd"), ("adam", "fo adam", "optax adam")]
        pairs += [(k, f"fo {k}", f"optax {k}") for k in DEFAULT_COMPILE_PAIRS]
        add(
            "3. compile step / optax (every optimizer, ≥ 100 leaves)",
            "tree",
            [
                (f"{k} {r['leaves']} leaves", r["seconds"][a] / r["seconds"][b])
                for r in comp
                if r["leaves"] >= 100
                for k, a, b in pairs
                if a in r["seconds"] and b in r["seconds"]
            ],
            1.0,
        )
    small = [
        r for k in ("sgd", "adam") for r in result.get(k, []) if r["params"] <= 100_000 and r["leaves"] >= 100
    ]
    for layout, name in (("tree, fused=True", "fo fused"), ("flat, fused=True", "fo flat")):
        add(
            "4. small model step / torch fused=True",
            layout,
            [(label(r), ratio(r, name, "torch fused")) for r in small],
            1.0,
        )
    return out


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _size(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def markdown(result: dict[str, Any]) -> str:
    lines = []
    steps = [r for k in STEP_KINDS for r in result.get(k, [])]
    if steps:
        lines += [
            "### Optimizer step, float32 (median ms; % of the in-place ceiling measured in the same row)",
            "",
            "| step | params | leaves | functorch_optim | fo via update | fo fused=True | fo fused=False "
            "| fo flat fused | optax | torch foreach | torch fused | fo / optax | fo via update / optax "
            "| fo fused=False / optax "
            "| fo / torch fused | fo fused=True / torch fused "
            "| fo fused=True / optax | fo flat fused / torch fused | fo fused=True GB/s | ceiling GB/s "
            "| fo % | fo fused=True % | optax % | torch fused % "
            "| peak fo ×P | peak fo fused=True ×P | peak optax ×P |",
            "|" + "---|" * 27,
        ]
        for r in steps:
            t, f, m, q = r["times_ms"], r["fraction_of_ceiling"], r["memory_x_params"], r["ratios"]
            pct = lambda k, f=f: _fmt(100 * f[k], ".0f") if k in f else "—"
            lines.append(
                f"| {r['algorithm']} | {_size(r['params'])} | {r['leaves']} "
                f"| {_fmt(t.get('functorch_optim'))} | {_fmt(t.get('fo via update'))} "
                f"| {_fmt(t.get('fo fused'))} | {_fmt(t.get('fo fused=False'))} | {_fmt(t.get('fo flat'))} "
                f"| {_fmt(t.get('optax'))} | {_fmt(t.get('torch foreach'))} | {_fmt(t.get('torch fused'))} "
                f"| {_fmt(q.get('fo/optax'))} | {_fmt(q.get('fo via update/optax'))} "
                f"| {_fmt(q.get('fo fused=False/optax'))} "
                f"| {_fmt(q['fo/torch fused'])} | {_fmt(q.get('fo fused/torch fused'))} "
                f"| {_fmt(q.get('fo fused/optax'))} | {_fmt(q.get('fo flat/torch fused'))} "
                f"| {_fmt(r['gbps'].get('fo fused'), '.1f')} | {_fmt(r['ceiling_gbps'], '.1f')} "
                f"| {pct('functorch_optim')} | {pct('fo fused')} | {pct('optax')} | {pct('torch fused')} "
                f"| {_fmt(m.get('functorch_optim'))} | {_fmt(m.get('fo fused'))} | {_fmt(m.get('optax'))} |"
            )
        lines.append("")
    paired = [r for r in steps if any(r.get("paired", {}).values())]
    if paired:
        cell = lambda q: (
            "—"
            if not q
            else f"{_fmt(q['median'])} ({_fmt(q['low'])}–{_fmt(q['high'])})"
            if q["low"] is not None
            else _fmt(q["median"])
        )
        lines += [
            f"### Step / optax, paired per rep (median of the per-rep ratios, its {CONFIDENCE:.0%} interval)",
            "",
            "Each rep times every contender once, one after another: a rep's ratio cancels "
            "what slows the whole machine during it. An interval above 1: slower than optax "
            "beyond the noise; below 1: faster; across 1: not told apart by this run.",
            "",
            "| step | params | leaves | reps | functorch_optim / optax | fo via update / optax "
            "| fo fused=False / optax |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in paired:
            q = r["paired"]
            reps = next(v["reps"] for v in q.values() if v)
            lines.append(
                f"| {r['algorithm']} | {_size(r['params'])} | {r['leaves']} | {reps} "
                f"| {cell(q.get('fo/optax'))} | {cell(q.get('fo via update/optax'))} "
                f"| {cell(q.get('fo fused=False/optax'))} |"
            )
        lines.append("")
    if result.get("accumulate"):
        lines += [
            "### grad_accumulate(sgd), float32 (median ms; the window step closes a window of 2)",
            "",
            "| params | leaves | layout | micro-step | bare acc+g | micro / bare | passthrough acc+g "
            "| micro / passthrough | MultiSteps micro-step "
            "| MultiSteps / micro | window step | plain step | window / plain | (window − micro) / plain "
            "| torch grad.add_ | peak micro ×P | peak window ×P | peak bare ×P | peak MultiSteps ×P "
            "| weighted micro-step | bare acc+w·g | weighted / bare |",
            "|---" * 22 + "|",
        ]
        for r in result["accumulate"]:
            t, q, m = r["times_ms"], r["ratios"], r["memory_x_params"]
            for layout, prefix, bare, _, _ in ACCUMULATE_LAYOUTS:
                micro, window, plain = (f"{prefix} {k} step" for k in ("micro", "window", "plain"))
                lines.append(
                    f"| {_size(r['params'])} | {r['leaves']} | {layout} | {_fmt(t.get(micro))} "
                    f"| {_fmt(t.get(bare))} | {_fmt(q.get(f'{prefix} micro/bare'))} "
                    f"| {_fmt(t.get(f'{prefix} passthrough acc+g'))} "
                    f"| {_fmt(q.get(f'{prefix} micro/passthrough'))} "
                    f"| {_fmt(t.get('optax MultiSteps micro-step'))} "
                    f"| {_fmt(q.get(f'MultiSteps micro/{prefix} micro'), '.1f')} | {_fmt(t.get(window))} "
                    f"| {_fmt(t.get(plain))} | {_fmt(q.get(f'{prefix} window/plain'))} "
                    f"| {_fmt(q.get(f'{prefix} (window - micro)/plain'))} | {_fmt(t.get('torch grad.add_'))} "
                    f"| {_fmt(m.get(micro))} | {_fmt(m.get(window))} | {_fmt(m.get(bare))} "
                    f"| {_fmt(m.get('optax MultiSteps micro-step'))} "
                    f"| {_fmt(t.get(f'{prefix} weighted micro step'))} "
                    f"| {_fmt(t.get(bare.replace('acc+g', 'acc+w*g')))} "
                    f"| {_fmt(q.get(f'{prefix} weighted micro/bare'))} |"
                )
        lines.append("")
    if result.get("compile"):
        names = list(result["compile"][0]["seconds"])
        lines += [
            "### Compile time (trace + XLA compile, seconds)",
            "",
            "| leaves | "
            + " | ".join(names)
            + " | fo / optax sgd | fo fused / optax sgd | fo flat / optax sgd | fo / MultiSteps "
            "| fo fused / MultiSteps | fo flat / MultiSteps | fo adam flat / optax adam |",
            "|---|" + "---|" * (len(names) + 7),
        ]
        for r in result["compile"]:
            s, q = r["seconds"], r["ratios"]
            lines.append(
                f"| {r['leaves']} | "
                + " | ".join(_fmt(s[n]) for n in names)
                + f" | {_fmt(q['fo sgd/optax sgd'])} | {_fmt(q.get('fo sgd fused/optax sgd'))} "
                + f"| {_fmt(q.get('fo sgd flat/optax sgd'))} "
                + f"| {_fmt(q['fo grad_accumulate/optax MultiSteps'])} "
                + f"| {_fmt(q.get('fo grad_accumulate fused/optax MultiSteps'))} "
                + f"| {_fmt(q.get('fo grad_accumulate flat/optax MultiSteps'))} "
                + f"| {_fmt(q.get('fo adam flat/optax adam'))} |"
            )
        rounds = {r["leaves"]: r.get("rounds", 1) for r in result["compile"]}
        lines += [
            "",
            "Cold compiles per cell (JAX's caches cleared before each): "
            + ", ".join(f"{k} leaves {'one' if n == 1 else f'the median of {n}'}" for k, n in rounds.items())
            + ".",
        ]
        lines.append("")
    checks = targets(result)
    if checks:
        lines += [
            "### Speed targets (the worst value over the rows each covers)",
            "",
            "| target | layout | worst | case | limit | holds |",
            "|---|---|---|---|---|---|",
        ]
        for c in checks:
            lines.append(
                f"| {c['target']} | {c['layout']} | {_fmt(c['worst'])} | {c['case']} | {c['limit']} "
                f"| {'yes' if c['holds'] else 'no'} |"
            )
        lines.append("")
    if result.get("train"):
        from functorch_optim import _bench_train

        lines += [*_bench_train.markdown(result["train"]), ""]
    meta = result["meta"]
    if meta.get("note"):
        lines.append(f"Note: {meta['note']}")
    lines.append(
        f"{meta['machine']}; jax {meta['jax']}, optax {meta['optax']}, torch {meta['torch']}; "
        f"{meta['reps']} timed reps per contender, round-robin, each after {meta.get('settle', 0)} "
        f"untimed; load average {meta['load_before']} → "
        f"{meta['load_after']}; {meta['wall_s']:.0f} s."
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for k in STEP_KINDS for r in result.get(k, [])]
    panels = [p for p in ("steps", "accumulate", "compile") if (steps if p == "steps" else result.get(p))]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=False):
        if panel == "steps":
            names = [
                "functorch_optim",
                "fo fused",
                "fo fused=False",
                "fo flat",
                "optax",
                "torch foreach",
                "torch fused",
            ]
            labels = [f"{r['algorithm']} {_size(r['params'])}×{r['leaves']}" for r in steps]
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                vals = [100 * r["fraction_of_ceiling"].get(name, float("nan")) for r in steps]
                ax.bar(np.arange(len(steps)) + i * width, vals, width, label=name)
            ax.axhline(100, color="k", lw=0.8, ls="--")
            ax.axhline(85, color="grey", lw=0.8, ls=":")
            ax.set_xticks(
                np.arange(len(steps)) + 0.4 - width / 2, labels, rotation=60, ha="right", fontsize=7
            )
            ax.set_ylabel("% of in-place bandwidth ceiling")
            ax.set_title("optimizer step (float32)")
        elif panel == "accumulate":
            rows = result["accumulate"]
            names = [f"{prefix} micro step" for _, prefix, _, _, _ in ACCUMULATE_LAYOUTS]
            names += ["optax MultiSteps micro-step", "torch grad.add_"]
            labels = [f"{_size(r['params'])}×{r['leaves']}" for r in rows]
            width = 0.8 / len(names)
            bare = lambda r, name: r["times_ms"]["bare flat acc+g" if "flat" in name else "bare acc+g"]
            for i, name in enumerate(names):
                vals = [r["times_ms"].get(name, float("nan")) / bare(r, name) for r in rows]
                ax.bar(np.arange(len(rows)) + i * width, vals, width, label=name)
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.set_yscale("log")
            ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, labels, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel("micro-step time / bare jitted acc + g (same layout)")
            ax.set_title("grad accumulation micro-step")
        else:
            rows = result["compile"]
            for name in rows[0]["seconds"]:
                ax.plot(
                    [r["leaves"] for r in rows], [r["seconds"][name] for r in rows], marker="o", label=name
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("leaves")
            ax.set_ylabel("trace + compile (s)")
            ax.set_title("compile time")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- entry points


def _cli_args() -> list[str]:
    args = sys.argv[1:]
    return args[1:] if args[:1] == ["bench"] else args


def run(
    sections: Sequence[str] = SECTIONS,
    quick: bool = False,
    reps: int | None = None,
    cases: Sequence[tuple[int, int]] | None = None,
    compile_leaves: Sequence[int] | None = None,
    log: Callable[[str], None] = lambda s: None,
    settle: int = 1,
    note: str | None = None,
    train_compile_rounds: int | None = None,
) -> dict[str, Any]:
    """Run the benchmark sections and return the results as a JSON-able dict.

    ``train_compile_rounds``: cold compiles per contender in the whole-step (``train``)
    section, whose median it reports (default 3; 1 with ``quick``)."""
    cases = tuple(cases or (QUICK_CASES if quick else FULL_CASES))
    compile_leaves = tuple(compile_leaves or (QUICK_COMPILE_LEAVES if quick else FULL_COMPILE_LEAVES))
    reps = reps or (5 if quick else 9)
    torch = _torch()
    if torch is None:
        log("no torch rows: torch is not installed (pip install 'functorch_optim[torch]') or cannot run here")
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "meta": {
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {jax.devices()[0].device_kind}",
            "jax": jax.__version__,
            "optax": optax.__version__,
            "torch": None if torch is None else torch.torch.__version__,
            "torch_device": None if torch is None else torch.device,
            "torch_threads": None if torch is None else torch.torch.get_num_threads(),
            "functorch_optim": fo.__version__,
            "fo_adam": hasattr(fo, "adam"),
            "reps": reps,
            "settle": settle,
            "quick": quick,
            "dtype": "float32",
            "load_before": [round(x, 2) for x in os.getloadavg()],
            "command": " ".join(["python -m functorch_optim bench", *_cli_args()]),
            "note": note,
        }
    }
    for kind in STEP_KINDS:
        if kind in sections:
            result[kind] = bench_steps(kind, cases, reps, log, settle)
    if "accumulate" in sections:
        # 100 leaves x 1k is a host-overhead case; accumulation is about large models
        acc_cases = [c for c in cases if c[0] >= 100_000 and c[1] != 100] if not quick else cases[:2]
        result["accumulate"] = bench_accumulate(acc_cases, reps, log, settle)
    if "compile" in sections:
        result["compile"] = bench_compile(compile_leaves, log)
    if "train" in sections:
        from functorch_optim._bench_train import bench_train

        result["train"] = bench_train(quick, reps, log, settle, train_compile_rounds)
    result["meta"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    result["meta"]["wall_s"] = time.perf_counter() - t0
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes and few reps (a smoke test)")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run (default: all)"
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        metavar="PARAMSxLEAVES",
        help="cases like 1e7x1 1e7x200 (default: 1e6, 1e7, 5e7 parameters in 1 and 200 leaves; 1e5 in 100)",
    )
    parser.add_argument("--compile-leaves", nargs="+", type=int, help="leaf counts for compile times")
    parser.add_argument("--reps", type=int, help="timed reps per contender (default 9; 5 with --quick)")
    parser.add_argument(
        "--settle",
        type=int,
        default=1,
        help="untimed calls of a contender right before each timed one (default 1; 0 times "
        "each call right after another contender's)",
    )
    parser.add_argument(
        "--compile-rounds",
        type=int,
        help="cold compiles per contender of the whole training step, their median reported "
        "(default 3; 1 with --quick)",
    )
    parser.add_argument("--note", help="a line recorded in the results' meta (e.g. how busy the machine was)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="PATH", default="bench.png", help="plot file (default bench.png)")
    parser.add_argument("--no-plot", action="store_true", help="skip the plot")
    parser.add_argument("--markdown", metavar="PATH", help="also write the markdown tables to a file")
    parser.add_argument(
        "--from-json",
        nargs="+",
        metavar="PATH",
        help="measure nothing: merge these result files (e.g. one per section) into tables and a plot",
    )


def _parse_case(text: str) -> tuple[int, int]:
    params, _, leaves = text.lower().partition("x")
    return int(float(params)), int(leaves or 1)


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs (e.g. one per section); meta from the first, load and
    wall time over all."""
    out: dict[str, Any] = {"meta": dict(results[0]["meta"])}
    for r in results:
        for key, rows in r.items():
            if key != "meta":
                out.setdefault(key, []).extend(rows)
    out["meta"]["load_after"] = results[-1]["meta"]["load_after"]
    out["meta"]["wall_s"] = sum(r["meta"]["wall_s"] for r in results)
    out["meta"]["runs"] = [r["meta"].get("command") for r in results]
    return out


def run_cli(args: argparse.Namespace) -> int:
    log = lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True)
    if not args.no_plot:
        import matplotlib  # noqa: F401  (the plot comes last: fail before measuring)
    cases = [_parse_case(s) for s in args.sizes] if args.sizes else None
    if args.from_json:
        parts = []
        for path in args.from_json:
            with open(path) as fh:
                parts.append(json.load(fh))
        result = merge(parts)
    else:
        result = run(
            args.sections,
            args.quick,
            args.reps,
            cases,
            args.compile_leaves,
            log,
            args.settle,
            args.note,
            args.compile_rounds,
        )
    table = markdown(result)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table + "\n")
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if not args.no_plot:
        plot(result, args.plot)
        log(f"plot written to {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``bench`` subcommand of ``python -m functorch_optim``."""
    bench = subparsers.add_parser(
        "bench", help="optimizer-step benchmark against optax and torch", description=__doc__.splitlines()[0]
    )
    add_arguments(bench)
    bench.set_defaults(func=run_cli)
