"""Bridges to other frameworks; ``functorch_optim.interop.torch`` converts torch weights."""
