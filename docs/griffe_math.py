"""Griffe extension: reST math in docstrings (``.. math::``, ``:math:``) as MathJax markup.

The package's docstrings write update rules the way torch's do (reST ``.. math::``
blocks); mkdocstrings renders Markdown, where ``pymdownx.arithmatex`` expects
``$$ ... $$`` and ``$ ... $``. This extension rewrites the docstring text once loaded.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

_ROLE = re.compile(r":math:`([^`]+)`")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rest_math_to_markdown(text: str) -> str:
    """Rewrite ``.. math::`` blocks and ``:math:`` roles of a docstring as ``$$``/``$``."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)\.\. math::\s*(.*)$", line)
        if not m:
            out.append(_ROLE.sub(r"$\1$", line))
            i += 1
            continue
        indent, first = m.group(1), m.group(2)
        body = [first] if first.strip() else []
        i += 1
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        if first.strip() and block:
            # continuation lines of an inline ``.. math:: a = b`` are aligned under it
            body += [b.strip() for b in block]
        else:
            body += textwrap.dedent("\n".join(block)).splitlines()
        math = "\n".join(b for b in body if b.strip())
        if "&" in math or "\\\\" in math:
            math = "\\begin{aligned}\n" + math + "\n\\end{aligned}"
        out += ["", indent + "$$", *(indent + m_ for m_ in math.splitlines()), indent + "$$", ""]
    return "\n".join(out)


class RestMath(griffe.Extension):
    """Convert reST math in every docstring to arithmatex markup."""

    def on_object(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rest_math_to_markdown(obj.docstring.value)
