"""Optimizer-step benchmark; the same as ``python -m functorch_optim bench``.

Examples::

    python benchmarks/bench.py --quick --json bench.json
    python benchmarks/bench.py --sections sgd --sizes 1e7x1 5e7x200
    python benchmarks/bench.py --json benchmarks/results/cpu.json --plot benchmarks/results/cpu.png

See ``functorch_optim/_bench.py`` for what is measured and how.
"""

import sys

from functorch_optim._bench import main

if __name__ == "__main__":
    sys.exit(main())
