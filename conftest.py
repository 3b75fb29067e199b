"""Strict JAX for every test and doctest: x64 available, no silent rank promotion."""

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
