"""Griffe extension: the facade classes made by ``make_optimizer_class``, as classes.

``functorch_optim.optim`` builds its torch-named classes in one line each
(``SGD = make_optimizer_class(sgd)``), so griffe's static analysis sees an assignment,
and the API page would show that line. This extension replaces each such attribute by a
class with the live class's docstring, its constructor's signature (torch's arguments and
defaults) and ``Optimizer`` as its base, so that mkdocstrings renders the signature, the
arguments and the inherited methods.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import griffe

sys.path.insert(0, str(Path(__file__).resolve().parent))

from griffe_math import rest_math_to_markdown

MODULE = "functorch_optim.optim"
BASE = "functorch_optim.optim.Optimizer"

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _args_entries(doc: str) -> dict[str, list[str]]:
    """The entries of a Google-style ``Args:`` section: name -> its lines (as written)."""
    out: dict[str, list[str]] = {}
    lines = doc.splitlines()
    if "Args:" not in lines:
        return out
    name = None
    for line in lines[lines.index("Args:") + 1 :]:
        if line and not line.startswith(" "):
            break  # the next section
        if line.startswith("  ") and not line.startswith("   ") and ":" in line:
            name = line.strip().split(":")[0].lstrip("*")
            out[name] = [line]
        elif name is not None:
            out[name].append(line)
    return out


def _with_every_argument(doc: str, cls: type) -> str:
    """``doc`` with its ``**hyperparameters`` entry replaced by one entry per argument
    of the signature, as the functional factory's docstring describes it."""
    own = _args_entries(doc)
    if "hyperparameters" not in own:
        return doc
    factory = _args_entries(inspect.getdoc(cls.factory) or "")
    entries = []
    for name in inspect.signature(cls).parameters:
        if name in own and name != "hyperparameters":
            continue
        entries += factory.get(name, [f"  {name}: accepted for torch compatibility; no effect."])
    block = "\n".join(own["hyperparameters"])
    return doc.replace(block, "\n".join(entries).rstrip())


def facade_class(cls: type, attribute: griffe.Object) -> griffe.Class:
    """A griffe class for the live ``cls``, placed where ``attribute`` is defined."""
    where = {"lineno": attribute.lineno, "endlineno": attribute.endlineno}
    doc = rest_math_to_markdown(_with_every_argument(inspect.cleandoc(cls.__doc__ or ""), cls))
    out = griffe.Class(cls.__name__, docstring=griffe.Docstring(doc, **where), bases=[BASE], **where)
    params = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
    for p in inspect.signature(cls).parameters.values():
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        annotation = "Any" if p.annotation is inspect.Parameter.empty else str(p.annotation)
        params.append(griffe.Parameter(p.name, kind=_KINDS[p.kind], default=default, annotation=annotation))
    out.set_member("__init__", griffe.Function("__init__", parameters=griffe.Parameters(*params), **where))
    return out


class FacadeClasses(griffe.Extension):
    """Document ``X = make_optimizer_class(...)`` as the class it makes."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != MODULE.partition(".")[0]:
            return
        module = pkg.get_member(MODULE.partition(".")[2])
        live = importlib.import_module(MODULE)
        for name, member in list(module.members.items()):
            if member.is_alias or not member.is_attribute:
                continue
            if not str(getattr(member, "value", "")).startswith("make_optimizer_class("):
                continue
            module.set_member(name, facade_class(getattr(live, name), member))
