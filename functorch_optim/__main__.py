"""``python -m functorch_optim <command>`` and the ``functorch-optim`` console script.

Each subcommand lives in its own module and plugs in here with one line: a function
that adds its parser to the subparsers and sets ``func`` (``args -> exit status``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (module, function adding the subcommand's parser); imported lazily on startup
SUBCOMMANDS: list[tuple[str, str]] = [
    ("functorch_optim.parity", "add_parser"),
    ("functorch_optim._demo", "add_parser"),
    ("functorch_optim._bench", "add_parser"),
]


#: optional dependencies a subcommand may import: module -> how to install it
OPTIONAL = {
    "torch": "pip install 'functorch_optim[torch]'",
    "tqdm": "pip install tqdm (or 'functorch_optim[test]')",
    "matplotlib": "pip install matplotlib (or 'functorch_optim[test]')",
    "orbax": "pip install 'functorch_optim[checkpoint]'",
}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="functorch-optim",
        description="torch.optim as pure JAX functions: tools and reports.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module, function in SUBCOMMANDS:
        getattr(importlib.import_module(module), function)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit status.

    A missing optional dependency (``OPTIONAL``) ends the subcommand with a line saying
    what to install and exit status 2, not a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in OPTIONAL:
            raise
        print(
            f"functorch-optim {args.command}: needs {missing}, which is not installed; {OPTIONAL[missing]}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
