"""MkDocs hooks: one API page per public symbol, and the update-rules page, generated.

Everything is derived from the package at build time, so a new optimizer (a new entry
of ``functorch_optim._registry.OPTIMIZERS``) or a new public name appears in the site
without editing the docs:

* ``api/<module>.<name>.md`` for every name in ``functorch_optim.__all__`` and in the
  ``__all__`` of the public submodules (``testing``, ``interop.torch``, ``parity``, and
  ``optim`` / ``schedules`` when present), listed under "API reference";
* ``update-rules.md``: each registered optimizer's update rule, taken from the math
  block of its factory's docstring;
* ``javascripts/mathjax/``: MathJax (``tex-mml-chtml.js``, its fonts and TeX extensions)
  copied from the ``django-static-mathjax`` package, so formulas render offline;
* the tables of contents of the notebook pages, rebuilt from the headings of the HTML
  that mkdocs-jupyter renders (its own TOC drops inline code from the names and links to
  anchors that the page does not have).
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File
from mkdocs.structure.toc import get_toc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from griffe_math import rest_math_to_markdown  # noqa: E402

SUBMODULES = (
    "functorch_optim.optim",
    "functorch_optim.nn.utils",
    "functorch_optim.schedules",
    "functorch_optim.testing",
    "functorch_optim.interop.torch",
    "functorch_optim.parity",
)


def public_symbols() -> list[tuple[str, str]]:
    """``(module, name)`` for every public symbol, package first."""
    import functorch_optim

    # submodules in __all__ (optim, schedules) get their members' pages below instead
    out = [
        ("functorch_optim", n)
        for n in sorted(functorch_optim.__all__)
        if not inspect.ismodule(getattr(functorch_optim, n))
    ]
    for mod_name in SUBMODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        out += [(mod_name, n) for n in sorted(getattr(mod, "__all__", ()))]
    return out


def _is_facade_class(module: str, name: str) -> bool:
    obj = getattr(importlib.import_module(module), name)
    from functorch_optim.optim import Optimizer

    return inspect.isclass(obj) and issubclass(obj, Optimizer) and obj is not Optimizer


def _page(module: str, name: str) -> str:
    return f"api/{module}.{name}.md"


def on_config(config, **kwargs):
    symbols = public_symbols()
    groups: dict[str, list] = {}
    for module, name in symbols:
        groups.setdefault(module, []).append({name: _page(module, name)})
    api = [{"Overview": "api/index.md"}] + [{m: entries} for m, entries in groups.items()]
    nav = config["nav"]
    for item in nav:
        if isinstance(item, dict) and "API reference" in item:
            item["API reference"] = api
    return config


def _update_rules() -> str:
    from functorch_optim._registry import OPTIMIZERS

    parts = [
        "# Update rules",
        "",
        "Each optimizer's rule for one parameter, as in its docstring (generated from the "
        "registry: every optimizer in `functorch_optim._registry.OPTIMIZERS`). Symbols follow "
        "torch's documentation: $\\gamma$ the learning rate, $\\theta$ the parameter, $g_t$ "
        "its gradient, $\\lambda$ the weight decay.",
        "",
    ]
    for spec in OPTIMIZERS:
        doc = inspect.getdoc(spec.factory) or ""
        summary = doc.split("\n\n")[0].replace("\n", " ")
        m = re.search(r"^\.\. math::.*?(?=^\S|\Z)", doc, re.S | re.M)
        parts += [f"## {spec.torch_name} — `functorch_optim.{spec.name}`", "", summary, ""]
        if m:
            parts += [rest_math_to_markdown(m.group(0)), ""]
        else:
            parts += ["(no math block in the docstring)", ""]
        parts += [f"API: [`{spec.name}`](api/functorch_optim.{spec.name}.md)", ""]
    return "\n".join(parts)


def _api_index(symbols) -> str:
    lines = ["# API reference", "", "Every public symbol, one page each, generated from its docstring.", ""]
    module = None
    for mod, name in symbols:
        if mod != module:
            lines += ["", f"## `{mod}`", ""]
            module = mod
        obj = getattr(importlib.import_module(mod), name)
        doc = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")
        if not callable(obj) and not inspect.isclass(obj) and not inspect.ismodule(obj):
            doc = ""
        lines.append(f"- [`{name}`]({mod}.{name}.md) — {doc}" if doc else f"- [`{name}`]({mod}.{name}.md)")
    return "\n".join(lines) + "\n"


#: what the site needs of MathJax's ``es5`` build: the component, its fonts, the TeX
#: extensions it may load on demand
MATHJAX_PARTS = ("tex-mml-chtml.js", "output/chtml/fonts/woff-v2", "input/tex/extensions")


def mathjax_root() -> Path:
    """MathJax's ``es5`` directory, from the ``django-static-mathjax`` package."""
    import mathjax

    return Path(mathjax.__file__).resolve().parent / "static" / "mathjax" / "es5"


def _mathjax_files(config) -> list[File]:
    root = mathjax_root()
    out = []
    for part in MATHJAX_PARTS:
        paths = [root / part] if (root / part).is_file() else sorted((root / part).rglob("*"))
        for path in paths:
            if path.is_file():
                rel = path.relative_to(root).as_posix()
                out.append(File.generated(config, f"javascripts/mathjax/{rel}", abs_src_path=str(path)))
    return out


_HEADING = re.compile(r"<h([1-6])\b[^>]*\bid=\"([^\"]+)\"[^>]*>(.*?)</h\1>", re.S)


def _heading_text(inner: str) -> str:
    inner = re.sub(r"<a\b[^>]*class=\"[^\"]*anchor-link[^\"]*\"[^>]*>.*?</a>", "", inner, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", inner)).split())


def notebook_toc_tokens(content: str) -> list[dict]:
    """The TOC tokens (Python-Markdown's shape) of the headings of rendered HTML."""
    root: list[dict] = []
    stack: list[dict] = []
    for level, anchor, inner in _HEADING.findall(content):
        token = {"level": int(level), "id": anchor, "name": _heading_text(inner), "children": []}
        while stack and stack[-1]["level"] >= token["level"]:
            stack.pop()
        (stack[-1]["children"] if stack else root).append(token)
        stack.append(token)
    return root


def on_page_content(html_content, page, config, files, **kwargs):
    if page.file.src_uri.endswith(".ipynb"):
        page.toc = get_toc(notebook_toc_tokens(html_content))
    return html_content


def on_files(files, config, **kwargs):
    symbols = public_symbols()
    for module, name in symbols:
        content = f"# `{module}.{name}`\n\n::: {module}.{name}\n"
        if _is_facade_class(module, name):
            # the methods (zero_grad, backward, step, state_dict, ...) are Optimizer's
            content += "    options:\n      inherited_members: true\n"
        files.append(File.generated(config, _page(module, name), content=content))
    files.append(File.generated(config, "api/index.md", content=_api_index(symbols)))
    files.append(File.generated(config, "update-rules.md", content=_update_rules()))
    for f in _mathjax_files(config):
        files.append(f)
    return files
