"""The few ``torch.nn.functional`` layers the ports need, as JAX functions in torch's layouts.

Weights keep torch's shapes (``Linear``: ``(out, in)``; ``Conv2d``: ``(out, in, kH, kW)``;
``ConvTranspose2d``: ``(in, out, kH, kW)``), so ``interop.torch.tree_from_module(model)``
gives the parameters these functions take. Activations are NCHW, as in torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_DIMS = ("NCHW", "OIHW", "NCHW")


def _last(v, y):
    """``v`` (one value per feature) shaped to broadcast over ``y``'s last axis explicitly."""
    return v.reshape((1,) * (y.ndim - 1) + v.shape)


def linear(p, x):
    """``nn.Linear``: ``x @ W.T + b`` (``b`` optional)."""
    y = x @ p["weight"].T
    return y + _last(p["bias"], y) if "bias" in p else y


def conv2d(p, x, stride=1, padding=0):
    """``nn.Conv2d`` (no dilation, no groups)."""
    y = jax.lax.conv_general_dilated(
        x, p["weight"], (stride, stride), [(padding, padding)] * 2, dimension_numbers=_DIMS
    )
    return y + p["bias"][None, :, None, None] if "bias" in p else y


def conv_transpose2d(p, x, stride=1, padding=0):
    """``nn.ConvTranspose2d``: a convolution of the stride-dilated input with the flipped kernel."""
    w = p["weight"]
    k = w.shape[-1]
    kernel = jnp.flip(w, (2, 3)).transpose(1, 0, 2, 3)
    pad = k - 1 - padding
    y = jax.lax.conv_general_dilated(
        x, kernel, (1, 1), [(pad, pad)] * 2, lhs_dilation=(stride, stride), dimension_numbers=_DIMS
    )
    return y + p["bias"][None, :, None, None] if "bias" in p else y


def batch_norm(p, x, eps=1e-5):
    """``nn.BatchNorm2d`` in training mode: normalised by the batch's (biased) statistics."""
    mean = jnp.mean(x, axis=(0, 2, 3), keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=(0, 2, 3), keepdims=True)
    y = (x - mean) / jnp.sqrt(var + eps)
    return y * p["weight"][None, :, None, None] + p["bias"][None, :, None, None]


def layer_norm(p, x, eps=1e-5):
    """``nn.LayerNorm`` over the last axis."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    y = (x - mean) / jnp.sqrt(var + eps)
    return y * _last(p["weight"], y) + _last(p["bias"], y)


def max_pool2d(x, k):
    """``F.max_pool2d(x, k)`` (stride ``k``)."""
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, k, k), (1, 1, k, k), "VALID")


def log_softmax(x, axis=-1):
    return jax.nn.log_softmax(x, axis=axis)


def nll_loss(logp, target, reduction="mean"):
    """``F.nll_loss`` over integer targets."""
    picked = -jnp.take_along_axis(logp, target[:, None], axis=1)[:, 0]
    return jnp.sum(picked) if reduction == "sum" else jnp.mean(picked)


def cross_entropy(logits, target):
    """``F.cross_entropy`` (mean)."""
    return nll_loss(log_softmax(logits, axis=1), target)


def bce_loss(p, y):
    """``nn.BCELoss`` (mean), with torch's clamp of the logs at -100."""
    log_p = jnp.maximum(jnp.log(p), -100.0)
    log_1p = jnp.maximum(jnp.log(1 - p), -100.0)
    return jnp.mean(-(y * log_p + (1 - y) * log_1p))


def dropout(x, rate, key):
    """``F.dropout`` in training mode (a JAX random mask: not torch's numbers for ``rate > 0``)."""
    if key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def lstm_cell(p, x, h, c):
    """``nn.LSTMCell``: torch's gate order (input, forget, cell, output)."""
    gates = linear({"weight": p["weight_ih"], "bias": p["bias_ih"]}, x)
    gates = gates + linear({"weight": p["weight_hh"], "bias": p["bias_hh"]}, h)
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c
