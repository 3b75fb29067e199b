"""The documentation: every public symbol has a docstring (as mkdocstrings/griffe sees it),
and every code block of the README and the docs pages runs as written."""

from __future__ import annotations

import importlib
import inspect
import re
import textwrap
from pathlib import Path

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


# --------------------------------------------------------------------------- code blocks

ROOT = Path(__file__).resolve().parent.parent
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*docs-test:\s*(?P<mode>continue|skip)\b(?P<why>.*?)-->")
_CLI = re.compile(r"^(?:\S*python\S* -m functorch_optim|functorch-optim)\b(?P<args>.*)$")


def code_blocks(path: Path) -> list[dict]:
    """The fenced blocks of a Markdown page: info string, line, body, and how the test runs it.

    A Python block runs on its own, in a fresh interpreter namespace; an HTML comment
    ``<!-- docs-test: continue -->`` on the line before it runs it after the page's
    previous block, in that block's namespace (a page that builds on itself), and
    ``<!-- docs-test: skip REASON -->`` leaves it out (the reason is required).
    """
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip().splitlines()
        mark = _MARK.search(before[-1]) if before else None
        out.append(
            {
                "info": m.group("info").strip(),
                "line": text.count("\n", 0, m.start()) + 1,
                "body": textwrap.dedent(m.group("body")),
                "mode": mark.group("mode") if mark else "fresh",
                "why": mark.group("why").strip() if mark else "",
            }
        )
    return out


def _python_pages():
    return [p for p in DOC_PAGES if any(b["info"].split(" ")[0] == "python" for b in code_blocks(p))]


_RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = None
for block in blocks:
    if block["mode"] != "continue" or namespace is None:
        namespace = {"__name__": "__main__"}
    try:
        exec(compile(block["body"], f"{block['page']}:{block['line']}", "exec"), namespace)
    except BaseException:
        print(f"the block at {block['page']}:{block['line']} fails:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    print(f"ok {block['page']}:{block['line']}")
"""


@pytest.mark.parametrize("page", _python_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs_as_written(page, tmp_path):
    import json
    import os
    import subprocess
    import sys

    blocks = []
    for b in code_blocks(page):
        if b["info"].split(" ")[0] != "python":
            continue
        if b["mode"] == "skip":
            assert b["why"], f"{page}:{b['line']}: a skipped block must say why"
            continue
        blocks.append({**b, "page": str(page.relative_to(ROOT))})
    # a fresh interpreter, as a reader runs the page: no test-suite configuration
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "FUNCTORCH_OPTIM_CACHE": os.environ.get("FUNCTORCH_OPTIM_CACHE", ""),
    }
    if not env["FUNCTORCH_OPTIM_CACHE"]:
        del env["FUNCTORCH_OPTIM_CACHE"]
    run = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("ok ") == len(blocks)


def _cli_lines():
    out = []
    for page in DOC_PAGES:
        for b in code_blocks(page):
            if b["info"].split(" ")[0] not in ("bash", "sh", "console", "shell"):
                continue
            for i, line in enumerate(b["body"].splitlines()):
                m = _CLI.match(line.split("  #")[0].strip().removeprefix("$ "))
                if m:
                    out.append((f"{page.relative_to(ROOT)}:{b['line'] + 1 + i}", m.group("args").split()))
    return out


@pytest.mark.parametrize(("where", "argv"), _cli_lines(), ids=[w for w, _ in _cli_lines()])
def test_every_command_line_in_the_docs_parses(where, argv):
    from functorch_optim.__main__ import build_parser

    if "--help" in argv or "-h" in argv:
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(argv)
        assert exit_.value.code == 0, where
        return
    args = build_parser().parse_args(argv)  # an unknown subcommand or flag exits (SystemExit 2)
    assert callable(args.func), where


def test_block_marks_are_read():
    import tempfile

    text = "```python\nx = 1\n```\n\n<!-- docs-test: continue -->\n```python\ny = x\n```\n"
    text += "<!-- docs-test: skip needs two processes -->\n```python\nz\n```\n"
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as fh:
        fh.write(text)
    blocks = code_blocks(Path(fh.name))
    assert [(b["mode"], b["line"], b["body"]) for b in blocks] == [
        ("fresh", 1, "x = 1\n"),
        ("continue", 6, "y = x\n"),
        ("skip", 10, "z\n"),
    ]
    assert blocks[2]["why"] == "needs two processes"


# --------------------------------------------------------------------------- the text

#: what user-facing text must not hold: paths outside the repository, issue numbers,
#: descriptions of the machine the project was developed on
FORBIDDEN = {
    "a path outside the repository": re.compile(r"(?<![\w./-])shared/\w"),
    "an issue number": re.compile(r"\bissues? ?#?\d+|\bissue-\d+|\bthe issue's\b", re.I),
    "a machine description": re.compile(
        r"\bVMs?\b|\bthis \d+-core\b|\bthe project's (shared )?(machine|computer)"
    ),
}


def _user_facing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "mkdocs.yml", *DOC_PAGES[1:]]
    files += sorted((ROOT / "examples").glob("*.ipynb"))
    files += sorted((ROOT / "functorch_optim").rglob("*.py"))  # docstrings and CLI output
    files += sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.md"))
    return sorted(set(files))


def _notebook_text(path: Path) -> str:
    import json

    cells = json.loads(path.read_text())["cells"]
    parts = []
    for cell in cells:
        parts.append("".join(cell["source"]))
        for output in cell.get("outputs", ()):
            parts.append("".join(output.get("text", "")))
            parts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


@pytest.mark.parametrize("path", _user_facing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_facing_text_speaks_of_the_project_alone(path):
    text = _notebook_text(path) if path.suffix == ".ipynb" else path.read_text()
    found = [
        f"{what}: {m.group(0)!r} in {line.strip()[:120]!r}"
        for what, pattern in FORBIDDEN.items()
        for line in text.splitlines()
        for m in [pattern.search(line)]
        if m
    ]
    assert not found, "\n".join(found)


def test_the_text_check_finds_what_it_forbids():
    samples = ["see shared/seeds", "(issue 7)", "issue-7 targets", "on this 2-core VM", "the issue's grid"]
    for sample in samples:
        assert any(p.search(sample) for p in FORBIDDEN.values()), sample
    allowed = ["on your machine", "tests/test_sharding.py", "fo.shared_state", "2 x86_64 cores"]
    for sample in allowed:
        assert not any(p.search(sample) for p in FORBIDDEN.values()), sample
