"""The built documentation site, as a reader gets it: offline, in a real browser.

The site is built strictly into ``site/`` (what ``make docs`` writes). Every page's
internal links and anchors are checked in its HTML; a few pages — the home page, an API
page, the update rules, a notebook — are opened in headless Chromium (Debian's
``chromium``, installed with apt-get when missing; the tests skip, saying why, where it
cannot be installed) with every host but this machine unreachable: MathJax must have
typeset every formula, the network log must hold no request that leaves the machine, and
screenshots of the home, an API and a notebook page are saved in ``site/``.
"""

from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
#: the pages opened in the browser, and the screenshots taken of three of them
BROWSED = {
    "home": "index.html",
    "api": "api/functorch_optim.optim.Adam/index.html",
    "rules": "update-rules/index.html",
    "notebook": "examples/03_porting_a_training_loop/index.html",
}
SCREENSHOTS = ("home", "api", "notebook")


@pytest.fixture(scope="module")
def site() -> Path:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(SITE)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    return SITE


def _pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


_HREF = re.compile(r"""<a\b[^>]*\bhref="([^"]*)\"""")
_ID = re.compile(r"""\bid="([^"]+)\"""")


def test_every_internal_link_and_anchor_exists(site):
    ids: dict[Path, set[str]] = {}
    broken = []
    for page in _pages(site):
        text = page.read_text(encoding="utf-8")
        ids[page] = {html.unescape(i) for i in _ID.findall(text)}
    for page in ids:
        for href in _HREF.findall(page.read_text(encoding="utf-8")):
            href = html.unescape(href)
            parts = urllib.parse.urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("mailto:"):
                continue
            target = (page.parent / urllib.parse.unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {href} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                if target not in ids:
                    ids[target] = set(_ID.findall(target.read_text(encoding="utf-8")))
                if urllib.parse.unquote(parts.fragment) not in ids[target]:
                    broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert not broken, f"{len(broken)} broken links, e.g.\n" + "\n".join(broken[:20])


def test_headings_with_code_keep_it_in_navigation_and_toc(site):
    notebook = (site / BROWSED["notebook"]).read_text(encoding="utf-8")
    # the nav title of notebook 01 (mkdocs.yml), not its h1 without its code spans
    assert "01 — , ," not in (site / "index.html").read_text(encoding="utf-8")
    assert "zero_grad, backward, step" in (site / "index.html").read_text(encoding="utf-8")
    first = (site / "examples/01_zero_grad_backward_step/index.html").read_text(encoding="utf-8")
    toc = re.findall(r'class="md-nav__link">\s*<span class="md-ellipsis">\s*(.*?)\s*</span>', first, re.S)
    assert "The experiment: two networks, one without zero_grad" in [" ".join(t.split()) for t in toc]
    assert 'class="md-nav__link"' in notebook


def test_facade_classes_have_signature_arguments_and_methods(site):
    from functorch_optim import optim

    classes = [n for n in optim.__all__ if isinstance(getattr(optim, n), type)]
    facades = [n for n in classes if issubclass(getattr(optim, n), optim.Optimizer) and n != "Optimizer"]
    assert len(facades) >= 14
    for name in facades:
        text = (site / f"api/functorch_optim.optim.{name}/index.html").read_text(encoding="utf-8")
        plain = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())
        assert "= make_optimizer_class(" not in plain, name
        assert f"{name} ( params" in plain, name  # the signature
        assert "Parameters: Name Type Description Default params" in plain, name
        for method in ("zero_grad", "backward", "step", "state_dict", "load_state_dict"):
            assert f'id="functorch_optim.optim.{name}.{method}"' in text, (name, method)
    sgd = (site / "api/functorch_optim.optim.SGD/index.html").read_text(encoding="utf-8")
    assert "momentum factor" in sgd and "nesterov" in sgd  # every argument, described


# --------------------------------------------------------------------------- browser


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if shutil.which("apt-get") and os.geteuid() == 0:
        quiet = {"capture_output": True, "text": True, "timeout": 900}
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, **quiet)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, check=False, **quiet)
        if shutil.which("chromium"):
            return shutil.which("chromium")
    pytest.skip("headless Chromium is not installed and could not be installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _browse(chromium: str, url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        # the browser's own background queries (not the page's): off, so the log holds the page's
        "--disable-features=NetworkTimeServiceQuerying,OptimizationHints,MediaRouter,Translate",
        f"--user-data-dir={tmp / 'profile'}",
        # every host but this machine unreachable: the site must not need one
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--virtual-time-budget=15000",
        "--window-size=1280,1000",
        *extra,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _page_requests(netlog: Path, origin: str) -> set[str]:
    """The URLs the page asked for: requests whose initiator is the site (the browser's
    own background requests have none)."""
    log = json.loads(netlog.read_text(errors="replace"))
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return {
        e["params"]["url"]
        for e in log["events"]
        if e["type"] == start and e.get("params", {}).get("initiator") == origin
    }


@pytest.fixture(scope="module")
def browsed(site, server, tmp_path_factory):
    """Each browsed page's DOM after its scripts ran, and the URLs it requested."""
    chromium = _chromium()
    out = {}
    for key, page in BROWSED.items():
        tmp = tmp_path_factory.mktemp(key)
        netlog = tmp / "net.json"
        run = _browse(chromium, f"{server}/{page}", tmp, "--dump-dom", f"--log-net-log={netlog}")
        assert run.returncode == 0 and "</html>" in run.stdout, run.stderr[-2000:]
        out[key] = (run.stdout, _page_requests(netlog, server))
        if key in SCREENSHOTS:
            shot = site / f"screenshot-{key}.png"
            run = _browse(chromium, f"{server}/{page}", tmp, f"--screenshot={shot}")
            assert shot.exists() and shot.stat().st_size > 10_000, run.stderr[-2000:]
    return out


def test_no_request_leaves_the_machine(browsed, server):
    for key, (_, urls) in browsed.items():
        assert any(u.endswith(".css") for u in urls), key  # the log holds the page's requests
        outside = sorted(u for u in urls if not u.startswith((server + "/", "data:", "blob:")))
        assert not outside, (key, outside)


def test_math_is_typeset_offline(browsed):
    for key in ("api", "rules"):
        dom, urls = browsed[key]
        assert any(u.endswith("/javascripts/mathjax/tex-mml-chtml.js") for u in urls), key
        typeset = dom.count("<mjx-container")
        spans = re.findall(r'<(span|div) class="arithmatex">(.*?)</\1>', dom, re.S)
        assert typeset >= 5, (key, typeset)
        raw = [inner for _, inner in spans if "mjx-container" not in inner]
        assert not raw, (key, raw[:3])
        assert "\\begin{aligned}" not in re.sub(r"<script.*?</script>", "", dom, flags=re.S), key
        assert "<mjx-merror" not in dom, key  # a formula MathJax could not parse


def test_screenshots_are_saved(browsed, site):
    for key in SCREENSHOTS:
        assert (site / f"screenshot-{key}.png").stat().st_size > 10_000
