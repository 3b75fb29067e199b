"""torch's rule for array-valued learning rates, shared by the torch-parity factories."""

from __future__ import annotations

import math
from typing import Any


def squeeze_lr(lr: Any) -> Any:
    """``lr`` as torch accepts it: a number, a schedule, or a 1-element array (squeezed).

    torch's constructors start with ``if isinstance(lr, Tensor) and lr.numel() != 1``
    and later squeeze a 1-element tensor to 0-d (``_to_scalar``); this does both for any
    array-like (JAX, NumPy or torch).

    Raises:
      ValueError: ``Tensor lr must be 1-element`` (torch's text) for an array whose size
        is not 1.
    """
    shape = getattr(lr, "shape", None)
    if shape is None or callable(lr):
        return lr
    if math.prod(shape) != 1:
        raise ValueError("Tensor lr must be 1-element")
    return lr.reshape(()) if len(shape) else lr
