"""The ports in ``examples/ports``: each torch script and its JAX port give the same run.

Per-step losses (and whatever else the scripts report: validation losses, learning
rates, GAN diagnostics) and the final weights, float64 to 1e-9 relative; one port also
in float32, to 1e-4.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from functorch_optim.interop.torch import flatten_names

PORTS = Path(__file__).resolve().parents[1] / "examples" / "ports"

#: port -> the arguments of the test run (dropout off: torch's and JAX's masks differ)
RUNS = {
    "mnist": ["--epochs", "2", "--dropout", "0", "0"],
    "word_language_model": ["--dropout", "0"],
    "dcgan": [],
    "imagenet": [],
    "time_sequence_prediction": [],
    "hf_no_trainer": [],
}


def _import(name):
    if str(PORTS) not in sys.path:
        sys.path.insert(0, str(PORTS))
    return importlib.import_module(name)


def _relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _compare(theirs, ours, tol):
    for key in theirs:
        if key == "params":
            continue
        assert len(ours[key]) == len(theirs[key]) > 0, key
        assert _relative(ours[key], theirs[key]) <= tol, (key, _relative(ours[key], theirs[key]))
    torch_params = {k: v.detach().numpy() for k, v in theirs["params"].items()}
    jax_params = flatten_names(ours["params"])
    assert sorted(jax_params) == sorted(torch_params)
    for name, value in torch_params.items():
        assert jax_params[name].dtype == value.dtype, name
        assert _relative(jax_params[name], value) <= tol, (name, _relative(jax_params[name], value))


@pytest.mark.parametrize("port", list(RUNS))
def test_port_equals_torch_float64(port):
    args = [*RUNS[port], "--double"] if port != "time_sequence_prediction" else RUNS[port]
    theirs = _import(f"{port}_torch").main(args)
    ours = _import(f"{port}_jax").main(args)
    _compare(theirs, ours, 1e-9)
    if port == "word_language_model":  # the run goes through the manual annealing
        assert theirs["lrs"][0] == 20 and theirs["lrs"][-1] < 20


def test_port_equals_torch_float32():
    theirs = _import("hf_no_trainer_torch").main([])
    ours = _import("hf_no_trainer_jax").main([])
    _compare(theirs, ours, 1e-4)
