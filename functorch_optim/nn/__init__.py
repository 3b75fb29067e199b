"""``torch.nn`` shaped helpers for the facade: ``functorch_optim.nn.utils``."""

from functorch_optim.nn import utils

__all__ = ["utils"]
