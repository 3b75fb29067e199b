"""The registry covers every optimizer factory of the public API."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import pytest

import functorch_optim as fo
from functorch_optim._hyperparams import HParams
from functorch_optim._registry import OPTIMIZERS, get_spec, product_grid


def _is_optimizer_factory(obj) -> bool:
    """A public callable that builds a transformation whose state holds HParams."""
    if not inspect.isfunction(obj):
        return False
    try:
        tx = obj()
        state = tx.init({"w": jnp.zeros((2, 2))})
    except Exception:
        return False
    return isinstance(getattr(state, "hparams", None), HParams)


def test_every_public_optimizer_is_registered():
    factories = {name for name in fo.__all__ if _is_optimizer_factory(getattr(fo, name))}
    registered = {spec.name for spec in OPTIMIZERS}
    assert "sgd" in factories
    assert factories <= registered, f"not in the registry: {sorted(factories - registered)}"
    assert registered <= set(fo.__all__), f"registered but not public: {sorted(registered - set(fo.__all__))}"


def test_grids_are_valid_for_both_libraries():
    torch = pytest.importorskip("torch")
    for spec in OPTIMIZERS:
        assert spec.grid, spec.name
        for config in spec.grid:
            spec.factory(**config)
            getattr(torch.optim, spec.torch_name)([torch.zeros(2, 2, requires_grad=True)], **config)


def test_lookup_by_either_name_and_unknown_error():
    assert get_spec("SGD") is get_spec("sgd")
    with pytest.raises(ValueError, match=r"unknown optimizer 'nope'; known: .*\bsgd\b"):
        get_spec("nope")


def test_product_grid():
    assert product_grid(a=(1, 2), b=(3,)) == ({"a": 1, "b": 3}, {"a": 2, "b": 3})
