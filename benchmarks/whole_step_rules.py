"""The default's choice between the kernel and the jitted rule in a whole training step,
per optimizer (not a test).

Where the jitted step computes the gradients (forward + backward + step in one ``jit``),
the default (``fused=None``) runs the rule where it costs nothing extra and the kernel
where the rule would emulate its FMAs (``_fused.rule_in_trace``). This times the bench's
whole steps (``_bench_train``: the 200-leaf MLP and the 12-layer transformer) for
several optimizers with the default, ``fused=False`` (the rule), ``fused=True`` (the
kernel) and optax's counterpart, rep by rep (``time_round_robin``), and prints each
one's step time over optax's per rep (median and its 95% interval) and the median of
cold compiles.

Usage: ``python benchmarks/whole_step_rules.py [--optimizers sgd sgd-momentum adagrad]
[--models mlp transformer] [--reps 30] [--rounds 3] [--markdown FILE] [--quick]`` (``--quick``:
the bench's small models, a smoke run)
"""

from __future__ import annotations

import argparse
import platform

import jax
import optax

import functorch_optim as fo
from functorch_optim._bench import compile_seconds, paired_ratio, time_round_robin
from functorch_optim._bench_train import FULL, QUICK, _fo_apply, _jax_contender, _optax_apply, model

LR = 1e-2
OPTIMIZERS = {
    "sgd": (lambda **k: fo.sgd(LR, **k), optax.sgd(LR)),
    "sgd-momentum": (lambda **k: fo.sgd(LR, momentum=0.9, **k), optax.sgd(LR, momentum=0.9)),
    "adagrad": (lambda **k: fo.adagrad(LR, **k), optax.adagrad(LR)),
    "adamw": (lambda **k: fo.adamw(LR, **k), optax.adamw(LR)),
}
FLAVOURS = {"default": {}, "fused=False": {"fused": False}, "fused=True": {"fused": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--optimizers", nargs="+", default=["sgd", "sgd-momentum", "adagrad"], choices=OPTIMIZERS
    )
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="cold compiles per contender")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--quick", action="store_true", help="the bench's small models (a smoke run)")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    lines = [
        f"Whole training step per optimizer ({platform.processor() or platform.machine()}, "
        f"jax {jax.__version__}, {args.reps} reps, compile: median of {args.rounds} cold compiles)",
        "",
        "| model | optimizer | optax ms | default / optax | fused=False / optax | fused=True / optax "
        "| compile s: optax | default | fused=False | fused=True |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in args.models:
        params, batch, loss, _, _ = model(kind, QUICK if args.quick else FULL)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        for name in args.optimizers:
            make, theirs = OPTIMIZERS[name]
            contenders = [_jax_contender("optax", loss, theirs, _optax_apply, params, batch, nbytes)]
            contenders += [
                _jax_contender(f, loss, make(**kw), _fo_apply, params, batch, nbytes)
                for f, kw in FLAVOURS.items()
            ]
            compiled = compile_seconds({c.name: c.extra.pop("compile") for c in contenders}, args.rounds)
            timings = time_round_robin(contenders, args.reps)
            cells = []
            for f in FLAVOURS:
                r = paired_ratio(timings, f, "optax")
                interval = "" if r["low"] is None else f" ({r['low']:.2f}–{r['high']:.2f})"
                cells.append(f"{r['median']:.3f}{interval}")
            times = " | ".join(f"{compiled[c]:.2f}" for c in ("optax", *FLAVOURS))
            optax_ms = 1e3 * timings["optax"]["median_s"]
            lines.append(f"| {kind} | {name} | {optax_ms:.2f} | " + " | ".join(cells) + f" | {times} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
