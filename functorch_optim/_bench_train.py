"""The bench's ``train`` section: a whole training step (forward + backward + AdamW).

An optimizer's step is only part of what a user pays: this section jits forward,
backward and the optimizer step of (a) an MLP of 100 dense layers (200 leaves) and (b) a
small pre-norm transformer language model (12 layers, 150 leaves), and times them with
functorch_optim's AdamW (the default, through ``fo.step`` and, optax's way, through
``tx.update`` + ``optax.apply_updates``; the kernel with ``fused=True``; ``fused=False``),
``optax.adamw`` (jit, donated) and torch's AdamW (eager single-tensor, ``foreach``, ``fused``, and the
``torch.compile``-d model with ``fused`` AdamW where it compiles; on CUDA where JAX runs
on a GPU, each step timed to the device's end), round-robin in one run. In the same
round robin, an accumulation micro-step of the whole step: ``fo.grad_accumulate`` (through
``fo.step`` and through ``update``), ``optax.MultiSteps`` and the bare add.
Reported per contender: step time, compile time (JAX: trace + compile of the whole step,
the median of cold compiles with JAX's caches cleared before each; also of forward +
backward alone, so the optimizer's share is the difference; torch
eager: none; ``torch.compile``: its first step minus a later one, compiled cold, with
inductor's on-disk cache in a fresh directory; JAX's persistent cache is off as well) and
peak memory (JAX: from XLA's buffer assignment; torch on the CPU keeps no peak counter,
so none).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import functorch_optim as fo
from functorch_optim._bench import (
    NEVER,
    Contender,
    TorchSide,
    compile_seconds,
    paired_ratio,
    peak_memory_units,
    time_round_robin,
)

LR, WEIGHT_DECAY = 1e-3, 1e-2
#: cold compiles per JAX contender (and of forward + backward alone) in a full run
COMPILE_ROUNDS = 3
#: (width, batch) of the MLP; (d_model, heads, seq, batch, vocab) of the transformer
FULL = {"mlp": (256, 64), "transformer": (128, 4, 64, 8, 512)}
QUICK = {"mlp": (32, 8), "transformer": (32, 2, 16, 2, 64)}
MLP_LAYERS, TRANSFORMER_LAYERS = 100, 12


# --------------------------------------------------------------------------- the models


def mlp_params(width: int, rng: np.random.Generator) -> dict[str, Any]:
    scale = 1 / math.sqrt(width)
    return {
        f"l{i:03d}": {
            "w": (rng.standard_normal((width, width)) * scale).astype(np.float32),
            "b": np.zeros((width,), np.float32),
        }
        for i in range(MLP_LAYERS)
    }


def _lead(v: jax.Array, x: jax.Array) -> jax.Array:
    """``v`` with leading unit axes up to ``x``'s rank: an explicit broadcast (the test
    suite runs with ``jax_numpy_rank_promotion="raise"``)."""
    return v.reshape((1,) * (x.ndim - v.ndim) + v.shape)


def _affine(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    y = x @ w
    return y + _lead(b, y)


def mlp_loss(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
    names = sorted(params)
    for i, name in enumerate(names):
        x = _affine(x, params[name]["w"], params[name]["b"])
        if i + 1 < len(names):
            x = jnp.tanh(x)
    return jnp.mean((x - y) ** 2)


def transformer_params(d: int, vocab: int, seq: int, rng: np.random.Generator) -> dict[str, Any]:
    def dense(n_in, n_out):
        return (rng.standard_normal((n_in, n_out)) / math.sqrt(n_in)).astype(np.float32)

    zeros, ones = (lambda n: np.zeros((n,), np.float32)), (lambda n: np.ones((n,), np.float32))
    layers = {
        f"h{i:02d}": {
            "ln1_g": ones(d),
            "ln1_b": zeros(d),
            "qkv_w": dense(d, 3 * d),
            "qkv_b": zeros(3 * d),
            "out_w": dense(d, d),
            "out_b": zeros(d),
            "ln2_g": ones(d),
            "ln2_b": zeros(d),
            "fc_w": dense(d, 4 * d),
            "fc_b": zeros(4 * d),
            "proj_w": dense(4 * d, d),
            "proj_b": zeros(d),
        }
        for i in range(TRANSFORMER_LAYERS)
    }
    return {
        "embed": (rng.standard_normal((vocab, d)) * 0.02).astype(np.float32),
        "pos": (rng.standard_normal((seq, d)) * 0.02).astype(np.float32),
        "layers": layers,
        "lnf_g": ones(d),
        "lnf_b": zeros(d),
        "head_w": dense(d, vocab),
        "head_b": zeros(vocab),
    }


def _layer_norm(x, g, b):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * _lead(g, x) + _lead(b, x)


def transformer_loss(params: dict[str, Any], tokens: jax.Array, heads: int) -> jax.Array:
    x = params["embed"][tokens[:, :-1]]
    x = x + _lead(params["pos"][: tokens.shape[1] - 1], x)
    batch, seq, d = x.shape
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    for name in sorted(params["layers"]):
        p = params["layers"][name]
        h = _affine(_layer_norm(x, p["ln1_g"], p["ln1_b"]), p["qkv_w"], p["qkv_b"])
        q, k, v = (t.reshape(batch, seq, heads, d // heads) for t in jnp.split(h, 3, axis=-1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
        attn = jax.nn.softmax(jnp.where(_lead(causal, scores), scores, -1e9), axis=-1)
        x = x + _affine(jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(batch, seq, d), p["out_w"], p["out_b"])
        h = jax.nn.gelu(
            _affine(_layer_norm(x, p["ln2_g"], p["ln2_b"]), p["fc_w"], p["fc_b"]), approximate=False
        )
        x = x + _affine(h, p["proj_w"], p["proj_b"])
    logits = _affine(_layer_norm(x, params["lnf_g"], params["lnf_b"]), params["head_w"], params["head_b"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def torch_model(torch: Any, kind: str, params: dict[str, Any], heads: int) -> Any:
    """The same model in torch (the same initial values, parameters in the same count)."""
    nn, F = torch.nn, torch.nn.functional

    def linear(w, b):
        layer = nn.Linear(*w.shape)
        with torch.no_grad():
            layer.weight.copy_(torch.as_tensor(w.T))
            layer.bias.copy_(torch.as_tensor(b))
        return layer

    if kind == "mlp":
        layers = []
        for i, name in enumerate(sorted(params)):
            layers.append(linear(params[name]["w"], params[name]["b"]))
            if i + 1 < len(params):
                layers.append(nn.Tanh())
        return nn.Sequential(*layers)

    def norm(g, b):
        layer = nn.LayerNorm(g.shape[0], eps=1e-5)
        with torch.no_grad():
            layer.weight.copy_(torch.as_tensor(g))
            layer.bias.copy_(torch.as_tensor(b))
        return layer

    class Block(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.ln1, self.qkv = norm(p["ln1_g"], p["ln1_b"]), linear(p["qkv_w"], p["qkv_b"])
            self.out, self.ln2 = linear(p["out_w"], p["out_b"]), norm(p["ln2_g"], p["ln2_b"])
            self.fc, self.proj = linear(p["fc_w"], p["fc_b"]), linear(p["proj_w"], p["proj_b"])

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = (
                t.reshape(b, s, heads, d // heads).transpose(1, 2)
                for t in self.qkv(self.ln1(x)).chunk(3, dim=-1)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
            x = x + self.out(a)
            return x + self.proj(F.gelu(self.fc(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(*params["embed"].shape)
            with torch.no_grad():
                self.embed.weight.copy_(torch.as_tensor(params["embed"]))
            self.pos = nn.Parameter(torch.as_tensor(params["pos"]).clone())
            self.blocks = nn.ModuleList(Block(params["layers"][n]) for n in sorted(params["layers"]))
            self.lnf = norm(params["lnf_g"], params["lnf_b"])
            self.head = linear(params["head_w"], params["head_b"])

        def forward(self, tokens):
            x = self.embed(tokens[:, :-1]) + self.pos[: tokens.shape[1] - 1]
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.lnf(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    return LM()


# --------------------------------------------------------------------------- contenders


def _jax_contender(name, loss, tx, apply, params, batch, param_bytes):
    """A jitted, donated ``(params, state, *batch) -> (params, state, loss)``; its compile
    time and peak memory."""

    def step(p, s, *b):
        value, grads = jax.value_and_grad(loss)(p, *b)
        p, s = apply(tx, p, grads, s)
        return p, s, value

    params = jax.tree.map(jnp.array, params)
    state = tx.init(params)

    def compile_step() -> Any:
        return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *batch).compile()

    compiled = compile_step()
    box = {"p": params, "s": state}

    def run():
        box["p"], box["s"], value = compiled(box["p"], box["s"], *batch)
        value.block_until_ready()

    memory = peak_memory_units(compiled, param_bytes)
    # ``compile_step`` lowers from the first params and state: time it before ``run``
    # donates them (``compile_seconds``)
    return Contender(name, run, memory=memory, extra={"compile": compile_step})


def _fo_apply(tx, p, g, s):
    return fo.step(tx, p, g, s)


def _optax_apply(tx, p, g, s):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s


#: the accumulation micro-step in a whole step (``every = NEVER``: no call steps), against
#: adding the gradient into an accumulator by hand; timed with the step's contenders
ADD_IN = "forward + backward + add"
MICRO = (
    ADD_IN,
    "fo grad_accumulate",
    "fo grad_accumulate via update",
    "optax MultiSteps",
)


def _micro_contenders(loss, params, batch, param_bytes) -> list[Contender]:
    """A micro-step of each way to accumulate AdamW's gradients: the bare add (the
    gradient added into a donated accumulator), ``fo.grad_accumulate`` through ``fo.step``
    and through ``update`` + ``apply_updates``, and ``optax.MultiSteps``. Not compile-timed
    (the ``accumulate`` section compares their compile times)."""

    def add_in(tx, p, g, s):
        return p, jax.tree.map(jnp.add, s, g)

    zeros = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), None)
    adamw = lambda: fo.adamw(LR, weight_decay=WEIGHT_DECAY)
    ways = [
        (ADD_IN, zeros, add_in),
        ("fo grad_accumulate", fo.grad_accumulate(adamw(), every=NEVER), _fo_apply),
        ("fo grad_accumulate via update", fo.grad_accumulate(adamw(), every=NEVER), _optax_apply),
        (
            "optax MultiSteps",
            optax.MultiSteps(optax.adamw(LR, weight_decay=WEIGHT_DECAY), every_k_schedule=NEVER),
            _optax_apply,
        ),
    ]
    out = []
    for name, tx, apply in ways:
        c = _jax_contender(name, loss, tx, apply, params, batch, param_bytes)
        c.extra.pop("compile")
        out.append(c)
    return out


@contextlib.contextmanager
def cold_inductor_cache() -> Iterator[str]:
    """``torch.compile`` compiling as in a fresh process on a fresh machine: inductor's
    on-disk cache (compiled graphs and C++ kernels, kept between processes in
    ``/tmp/torchinductor_<user>``) in a new empty directory while inside, so that a
    second bench run does not time cache hits as compile time (JAX's persistent cache is
    off by default). The directory is removed when the process exits (the loaded kernels
    stay mapped until then)."""
    path = tempfile.mkdtemp(prefix="fo-bench-inductor-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def _torch_contenders(torch: TorchSide | None, kind, params, heads, batch, log) -> list[Contender]:
    """torch's AdamW steps of the same model on ``torch.device`` (CUDA where JAX runs on a
    GPU): each timed call waits for the device (``TorchSide.timed``), as a JAX step's
    does."""
    if torch is None:
        return []
    t, device = torch.torch, torch.device
    if kind == "mlp":
        x, y = (t.as_tensor(np.array(a), device=device) for a in batch)  # a writable copy
        forward = lambda model: t.mean((model(x) - y) ** 2)
    else:
        tokens = t.as_tensor(np.array(batch[0]), dtype=t.long, device=device)
        forward = lambda model: model(tokens)
    out = []
    flavours = {"eager": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    for flavour, flags in [*flavours.items(), ("compile fused", {"fused": True})]:
        model = torch_model(t, kind, params, heads).to(device)
        opt = t.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **flags)
        extra: dict[str, Any] = {}
        if flavour == "compile fused":
            try:
                model = t.compile(model)
            except Exception as error:  # pragma: no cover - no torch.compile here
                log(f"train {kind}: torch.compile unavailable ({type(error).__name__}: {error})")
                continue

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            forward(model).backward()
            opt.step()

        run = torch.timed(step)
        if flavour == "compile fused":
            try:
                with cold_inductor_cache():
                    t0 = time.perf_counter()
                    run()
                    first = time.perf_counter() - t0
                t0 = time.perf_counter()
                run()
                extra["compile_s"] = first - (time.perf_counter() - t0)
            except Exception as error:  # the compiler failed on this machine: no row
                log(f"train {kind}: torch.compile failed ({type(error).__name__}: {str(error)[:200]})")
                continue
        out.append(Contender(f"torch {flavour}", run, extra=extra))
    return out


def model(kind: str, sizes: dict[str, tuple[int, ...]]) -> tuple[dict[str, Any], tuple, Callable, int, dict]:
    """``(params, batch, loss, heads, shape)`` of the bench's ``kind`` ("mlp" or
    "transformer") at ``sizes`` (``FULL`` or ``QUICK``), from a fixed seed; ``loss(params,
    *batch)``."""
    rng = np.random.default_rng(0)
    if kind == "mlp":
        width, batch_size = sizes["mlp"]
        params = mlp_params(width, rng)
        batch = (
            jnp.asarray(rng.standard_normal((batch_size, width)), jnp.float32),
            jnp.asarray(rng.standard_normal((batch_size, width)), jnp.float32),
        )
        return params, batch, mlp_loss, 0, {"layers": MLP_LAYERS, "width": width, "batch": batch_size}
    d, heads, seq, batch_size, vocab = sizes["transformer"]
    params = transformer_params(d, vocab, seq + 1, rng)
    batch = (jnp.asarray(rng.integers(0, vocab, (batch_size, seq + 1)), jnp.int32),)
    shape = {"layers": TRANSFORMER_LAYERS, "d_model": d, "heads": heads, "seq": seq}
    shape |= {"batch": batch_size, "vocab": vocab}
    return params, batch, lambda p, tokens: transformer_loss(p, tokens, heads), heads, shape


def bench_train(
    quick: bool, reps: int, log: Callable[[str], None], settle: int = 1, compile_rounds: int | None = None
) -> list[dict[str, Any]]:
    """The whole-step rows: one per model; compile times the median of ``compile_rounds``
    cold compiles per contender (default ``COMPILE_ROUNDS``; 1 with ``quick``)."""
    sizes = QUICK if quick else FULL
    torch = _torch_side()
    rows = []
    for kind in ("mlp", "transformer"):
        params, batch, loss, heads, shape = model(kind, sizes)
        leaves = jax.tree.leaves(params)
        n_params = sum(x.size for x in leaves)
        param_bytes = sum(x.nbytes for x in leaves)
        log(f"train {kind}: {len(leaves)} leaves, {n_params:,} params")
        jax_params = jax.tree.map(jnp.asarray, params)
        fwd_bwd = lambda: jax.jit(jax.value_and_grad(loss)).lower(jax_params, *batch).compile()  # noqa: B023
        contenders = [
            _jax_contender(
                "fo adamw",
                loss,
                fo.adamw(LR, weight_decay=WEIGHT_DECAY),
                _fo_apply,
                params,
                batch,
                param_bytes,
            ),
            # optax's way with this package's optimizer: update, then optax.apply_updates
            _jax_contender(
                "fo adamw via update",
                loss,
                fo.adamw(LR, weight_decay=WEIGHT_DECAY),
                _optax_apply,
                params,
                batch,
                param_bytes,
            ),
            _jax_contender(
                "fo adamw fused=True",
                loss,
                fo.adamw(LR, weight_decay=WEIGHT_DECAY, fused=True),
                _fo_apply,
                params,
                batch,
                param_bytes,
            ),
            _jax_contender(
                "fo adamw fused=False",
                loss,
                fo.adamw(LR, weight_decay=WEIGHT_DECAY, fused=False),
                _fo_apply,
                params,
                batch,
                param_bytes,
            ),
            _jax_contender(
                "optax adamw",
                loss,
                optax.adamw(LR, weight_decay=WEIGHT_DECAY),
                _optax_apply,
                params,
                batch,
                param_bytes,
            ),
            *_torch_contenders(torch, kind, params, heads, batch, log),
            *_micro_contenders(loss, params, batch, param_bytes),
        ]
        rounds = compile_rounds or (1 if quick else COMPILE_ROUNDS)
        log(f"train {kind}: compile times, median of {rounds} cold compiles each")
        jax_compilers = {c.name: c.extra.pop("compile") for c in contenders if "compile" in c.extra}
        compiled_s = compile_seconds({"forward + backward": fwd_bwd, **jax_compilers}, rounds)
        fwd_bwd_compile = compiled_s.pop("forward + backward")
        timings = time_round_robin(contenders, reps, settle=settle)
        micro = {c.name: c for c in contenders if c.name in MICRO}
        contenders = [c for c in contenders if c.name not in MICRO]
        times = {c.name: 1e3 * timings[c.name]["median_s"] for c in contenders}
        compile_s = compiled_s | {c.name: c.extra["compile_s"] for c in contenders if "compile_s" in c.extra}
        row = {
            "model": kind,
            "leaves": len(leaves),
            "params": int(n_params),
            "shape": shape,
            "times_ms": times,
            "spread": {c.name: timings[c.name]["spread"] for c in contenders},
            "compile_s": compile_s,
            "compile_rounds": rounds,
            "fwd_bwd_compile_s": fwd_bwd_compile,
            "optimizer_compile_s": {
                k: v - fwd_bwd_compile for k, v in compile_s.items() if not k.startswith("torch")
            },
            "memory_x_params": {c.name: c.memory for c in contenders if c.memory is not None},
            "peak_mb": {c.name: c.memory * param_bytes / 2**20 for c in contenders if c.memory is not None},
        }
        row["ratios"] = {
            "fo/optax": times["fo adamw"] / times["optax adamw"],
            "fo via update/optax": times["fo adamw via update"] / times["optax adamw"],
            "fo fused=True/optax": times["fo adamw fused=True"] / times["optax adamw"],
            "fo fused=False/optax": times["fo adamw fused=False"] / times["optax adamw"],
        }
        if "torch fused" in times:
            row["ratios"]["fo/torch fused"] = times["fo adamw"] / times["torch fused"]
        # each rep times every contender once: per-rep ratios cancel the machine's drift
        row["paired_vs_optax"] = {
            n: paired_ratio(timings, n, "optax adamw")
            for n in ("fo adamw", "fo adamw via update", "fo adamw fused=True", "fo adamw fused=False")
        }
        row["micro_step"] = {
            "times_ms": {n: 1e3 * timings[n]["median_s"] for n in micro},
            "spread": {n: timings[n]["spread"] for n in micro},
            "memory_x_params": {n: c.memory for n, c in micro.items() if c.memory is not None},
            # over the bare add, rep by rep
            "paired_vs_add_in": {n: paired_ratio(timings, n, ADD_IN) for n in MICRO[1:]},
        }
        rows.append(row)
    return rows


def _torch_side() -> TorchSide | None:
    from functorch_optim._bench import _torch

    return _torch()


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    names = list(rows[0]["times_ms"])
    for r in rows[1:]:
        names += [n for n in r["times_ms"] if n not in names]
    fmt = lambda x, spec=".2f": "—" if x is None else format(x, spec)
    lines = [
        "### Whole training step: forward + backward + AdamW, float32 (median ms)",
        "",
        "| model | leaves | params | " + " | ".join(names) + " | fo / optax | fo fused=True / optax "
        "| fo fused=False / optax | fo / torch fused |",
        "|---|---|---|" + "---|" * len(names) + "---|---|---|---|",
    ]
    for r in rows:
        t, q = r["times_ms"], r["ratios"]
        lines.append(
            f"| {r['model']} | {r['leaves']} | {r['params']:,} | "
            + " | ".join(fmt(t.get(n)) for n in names)
            + f" | {fmt(q['fo/optax'])} | {fmt(q.get('fo fused=True/optax'))} "
            f"| {fmt(q['fo fused=False/optax'])} | {fmt(q.get('fo/torch fused'))} |"
        )
    paired = [r for r in rows if r.get("paired_vs_optax")]
    if paired:
        fo_names = list(paired[0]["paired_vs_optax"])
        lines += [
            "",
            "Against optax rep by rep (the median of the per-rep ratios and its 95% interval; "
            "above 1 beyond the noise where the interval is):",
            "",
            "| model | reps | " + " | ".join(f"{n} / optax" for n in fo_names) + " |",
            "|---|---|" + "---|" * len(fo_names),
        ]
        for r in paired:
            q = r["paired_vs_optax"]
            cells = [
                "—" if q[n] is None else f"{q[n]['median']:.2f} ({fmt(q[n]['low'])}–{fmt(q[n]['high'])})"
                for n in fo_names
            ]
            reps = next((q[n]["reps"] for n in fo_names if q[n] is not None), 0)
            lines.append(f"| {r['model']} | {reps} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Compile time (s; JAX: the whole jitted step, the median of "
        f"{rows[0].get('compile_rounds', 1)} cold compiles (JAX's caches cleared before each, "
        "after a discarded warm-up round), and the optimizer's share: minus forward + "
        "backward alone; torch.compile: first step minus a later one) and peak memory (XLA's "
        "buffer assignment, MiB and × the parameters' size; torch on the CPU has no peak counter):",
        "",
        "| model | contender | compile s | optimizer's share s | peak MiB | peak ×P |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for n in names:
            if n not in r["times_ms"]:
                continue
            lines.append(
                f"| {r['model']} | {n} | {fmt(r['compile_s'].get(n))} "
                f"| {fmt(r['optimizer_compile_s'].get(n))} | {fmt(r['peak_mb'].get(n), '.1f')} "
                f"| {fmt(r['memory_x_params'].get(n))} |"
            )
        lines.append(f"| {r['model']} | forward + backward alone | {fmt(r['fwd_bwd_compile_s'])} | | | |")
    micro = [r for r in rows if r.get("micro_step")]
    if micro:
        lines += [
            "",
            "Accumulating AdamW's gradients, a micro-step of the whole step (no call steps): "
            f"median ms, peak × the parameters, and over `{ADD_IN}` (the gradient added into "
            "a donated accumulator by hand) rep by rep, the median ratio and its 95% interval:",
            "",
            "| model | " + " | ".join(MICRO) + " | " + " | ".join(f"{n} / add" for n in MICRO[1:]) + " |",
            "|---|" + "---|" * (2 * len(MICRO) - 1),
        ]
        for r in micro:
            m = r["micro_step"]
            cells = [f"{fmt(m['times_ms'].get(n))} ({fmt(m['memory_x_params'].get(n))}×P)" for n in MICRO]
            for n in MICRO[1:]:
                q = m["paired_vs_add_in"].get(n)
                cells.append("—" if q is None else f"{q['median']:.2f} ({fmt(q['low'])}–{fmt(q['high'])})")
            lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    return lines
