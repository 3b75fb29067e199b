"""Command line: ``python -m functorch_optim <command>`` (also ``functorch-optim``)."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from functorch_optim import _demo

    result = _demo.run(steps=args.steps)
    return 0 if result["max_rel_diff"] <= 1e-9 else 1


def _run_bench(args: argparse.Namespace) -> int:
    from functorch_optim import _bench

    return _bench.run_cli(args)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    from functorch_optim import _bench

    bench = commands.add_parser(
        "bench",
        help="time optimizer steps next to optax and torch (foreach, fused)",
        description=_bench.__doc__.splitlines()[0],
    )
    _bench.add_arguments(bench)
    bench.set_defaults(run=_run_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="functorch_optim", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train an MLP with SGD + grad_accumulate next to torch")
    demo.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    demo.set_defaults(run=_demo)
    _add_bench(commands)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
