"""Every public symbol has a docstring, as the docs site (mkdocstrings/griffe) sees it."""

from __future__ import annotations

import importlib
import inspect

import pytest

griffe = pytest.importorskip("griffe")

import functorch_optim  # noqa: E402

# the public modules whose ``__all__`` is API (optim and schedules once they exist)
SUBMODULES = (
    "functorch_optim.optim",
    "functorch_optim.nn.utils",
    "functorch_optim.schedules",
    "functorch_optim.testing",
    "functorch_optim.interop.torch",
    "functorch_optim.parity",
)


def _public():
    out = [("functorch_optim", n) for n in functorch_optim.__all__]
    for name in SUBMODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        out += [(name, n) for n in getattr(mod, "__all__", ())]
    return out


PUBLIC = _public()


@pytest.fixture(scope="module")
def package():
    return griffe.load("functorch_optim", search_paths=["."], resolve_aliases=True)


def _griffe_object(package, module, name):
    obj = package
    for part in module.split(".")[1:]:
        obj = obj[part]
    return obj[name]


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_symbol_has_a_docstring(package, module, name):
    obj = _griffe_object(package, module, name)
    doc = obj.docstring.value.strip() if obj.docstring else ""
    assert doc, f"{module}.{name} has no docstring"
    live = getattr(importlib.import_module(module), name)
    if inspect.isclass(live) and issubclass(live, tuple):
        # a NamedTuple without its own docstring gets "Name(field, ...)" from Python
        assert not doc.startswith(f"{name}("), f"{module}.{name} only has the generated docstring"
    if callable(live) and not inspect.isclass(live):
        assert len(doc.splitlines()) >= 3, f"{module}.{name}: a one-line docstring; document Args/Returns"


def test_the_check_sees_every_public_module():
    modules = {m for m, _ in PUBLIC}
    assert {"functorch_optim", "functorch_optim.testing", "functorch_optim.interop.torch"} <= modules
    assert len(PUBLIC) >= len(functorch_optim.__all__) + 5


def test_missing_docstring_is_detected(tmp_path):
    pkg = tmp_path / "demo_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__all__ = ["f"]\n\ndef f(x):\n    return x\n')
    loaded = griffe.load("demo_pkg", search_paths=[str(tmp_path)])
    assert loaded["f"].docstring is None


def test_rest_math_becomes_arithmatex_markup():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "griffe_math.py"
    spec = importlib.util.spec_from_file_location("griffe_math", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = "Rule for :math:`\\theta`:\n\n.. math::\n\n    a &= b \\\\\n    c &= d\n\nAfter."
    assert mod.rest_math_to_markdown(text).splitlines() == [
        "Rule for $\\theta$:",
        "",
        "",
        "$$",
        "\\begin{aligned}",
        "a &= b \\\\",
        "c &= d",
        "\\end{aligned}",
        "$$",
        "",
        "After.",
    ]
    inline = ".. math:: \\bar g = \\frac{1}{k}\n          \\sum g_i\n\nNext."
    assert mod.rest_math_to_markdown(inline).splitlines()[1:5] == [
        "$$",
        "\\bar g = \\frac{1}{k}",
        "\\sum g_i",
        "$$",
    ]
