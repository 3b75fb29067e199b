"""Optimizer-step benchmark; the same as ``python -m functorch_optim bench``.

Examples::

    python benchmarks/bench.py --quick --json bench.json
    python benchmarks/bench.py --sections sgd --sizes 1e7x1 5e7x200
    python benchmarks/bench.py --json benchmarks/results/cpu.json --plot benchmarks/results/cpu.png

See ``functorch_optim/_bench.py`` for what is measured and how.
"""

import pathlib
import sys

try:
    import functorch_optim  # noqa: F401
except ImportError:  # run from a checkout without installing: use the checkout's package
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from functorch_optim._bench import main

if __name__ == "__main__":
    sys.exit(main())
