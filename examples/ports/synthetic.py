"""Small generated data for the ports (no downloads): both sides of a port read the same arrays.

Every generator is seeded NumPy, so a torch script and its JAX port see identical
batches in identical order.
"""

from __future__ import annotations

import numpy as np


def images(n: int, size: int, channels: int = 1, classes: int = 10, seed: int = 0) -> tuple:
    """``n`` images ``(n, channels, size, size)`` in float32 and their labels (int64).

    Each class is a fixed random pattern plus noise, so a small net can learn it.
    """
    rng = np.random.default_rng(seed)
    patterns = rng.standard_normal((classes, channels, size, size))
    labels = rng.integers(0, classes, n)
    x = patterns[labels] + 0.5 * rng.standard_normal((n, channels, size, size))
    return x.astype(np.float32), labels.astype(np.int64)


def tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """A token stream of length ``n`` (int64) from a random sparse bigram table."""
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(vocab, 0.2), size=vocab)
    out = np.empty(n, np.int64)
    out[0] = 0
    for i in range(1, n):
        out[i] = rng.choice(vocab, p=table[out[i - 1]])
    return out


def sine_waves(n: int = 100, length: int = 1000, period: int = 20, seed: int = 2) -> np.ndarray:
    """time_sequence_prediction's ``generate_sine_wave.py``: ``(n, length)`` float64 shifted sines."""
    rng = np.random.RandomState(seed)
    x = np.empty((n, length), "int64")
    x[:] = np.array(range(length)) + rng.randint(-4 * period, 4 * period, n).reshape(n, 1)
    return np.sin(x / 1.0 / period).astype("float64")


def batches(x: np.ndarray, y: np.ndarray, batch_size: int):
    """``(x, y)`` in consecutive batches, in order (a ``DataLoader`` without shuffling)."""
    for i in range(0, len(x), batch_size):
        yield x[i : i + batch_size], y[i : i + batch_size]
