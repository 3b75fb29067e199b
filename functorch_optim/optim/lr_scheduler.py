"""``functorch_optim.optim.lr_scheduler``: torch's scheduler classes over the facade's ``param_groups``.

A thin re-export of ``functorch_optim._lr_scheduler`` so that it sits where torch users
look for it (``torch.optim.lr_scheduler`` -> ``functorch_optim.optim.lr_scheduler``).
"""

from functorch_optim._lr_scheduler import (
    SWALR,
    ChainedScheduler,
    ConstantLR,
    CosineAnnealingLR,
    CosineAnnealingWarmRestarts,
    CyclicLR,
    ExponentialLR,
    LambdaLR,
    LinearLR,
    LRScheduler,
    MultiplicativeLR,
    MultiStepLR,
    OneCycleLR,
    PolynomialLR,
    ReduceLROnPlateau,
    SequentialLR,
    StepLR,
)

__all__ = [
    "SWALR",
    "ChainedScheduler",
    "ConstantLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "ExponentialLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "ReduceLROnPlateau",
    "SequentialLR",
    "StepLR",
]
