"""``functorch_optim.optim.lr_scheduler``: torch's scheduler classes over the facade's ``param_groups``.

A thin re-export of ``functorch_optim._lr_scheduler`` so that it sits where torch users
look for it (``torch.optim.lr_scheduler`` -> ``functorch_optim.optim.lr_scheduler``).
"""

from functorch_optim import _lr_scheduler
from functorch_optim._lr_scheduler import *  # noqa: F403  (the classes; the names: __all__)

__all__ = list(_lr_scheduler.__all__)
