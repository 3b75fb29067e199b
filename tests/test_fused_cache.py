"""The fused-kernel cache loads only a verified library built for this CPU.

Every case runs in a fresh process, so a crash (SIGBUS from a truncated library, SIGILL
from a build for another CPU, a planted library's code) is a failed test, not a dead
pytest. Each process has its own ``FUNCTORCH_OPTIM_CACHE``. The compiler is a small
wrapper around the real one (``CXX``): it replays an earlier build of the same command
(as ccache does), so a rebuild costs no compile time here, it logs each build, and with
``FAKE_MARCH`` set it builds for that target instead of ``-march=native``: the compiler
of a machine with another CPU; with ``FAIL_BUILD`` set every build fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from functorch_optim import _fused

pytestmark = pytest.mark.skipif(
    not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")), reason="needs a C++ compiler"
)

X86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")

WRAPPER = '''\
#!{python}
"""A C++ compiler for the tests: the real one, replayed from a cache, logged."""
import hashlib, os, shutil, subprocess, sys

real, args = {real!r}, sys.argv[1:]
if os.environ.get("FAKE_MARCH"):
    args = [f"-march={{os.environ['FAKE_MARCH']}}" if a == "-march=native" else a for a in args]
if "-###" in args or "-o" not in args:
    sys.exit(subprocess.call([real, *args]))
if os.environ.get("FAIL_BUILD"):
    sys.exit("c++: error: this build fails on purpose")
out = args[args.index("-o") + 1]
key = hashlib.sha256(repr([real, *(a for a in args if a != out)]).encode()).hexdigest()
stored = os.path.join({store!r}, key)
with open(os.environ["BUILD_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
if not os.path.exists(stored):
    code = subprocess.call([real, *args])
    if code:
        sys.exit(code)
    shutil.copyfile(out, stored + ".tmp")
    os.replace(stored + ".tmp", stored)
shutil.copyfile(stored, out)
'''

# The child: build/load through fused=True as a user does, then one fused Adam step
# against the jitted rule; prints what happened as JSON.
CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import functorch_optim as fo
    from functorch_optim import _fused

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fused = fo.adam(lr=0.1, fused=True)
        except RuntimeError as error:
            print(json.dumps({"error": str(error)}))
            sys.exit(0)
    params = {"w": jnp.linspace(-1.0, 1.0, 7)}
    grads = {"w": jnp.cos(params["w"] * 3)}
    out = []
    for tx in (fo.adam(lr=0.1), fused):
        step = jax.jit(lambda p, s, tx=tx: fo.step(tx, p, grads, s))
        p, s = params, tx.init(params)
        for _ in range(3):
            p, s = step(p, s)
        out.append(np.asarray(p["w"]).tolist())
    print(json.dumps({
        "path": _fused.load_kernels(),
        "warnings": [str(w.message) for w in caught],
        "same": out[0] == out[1],
    }))
    """
)

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE *f = fopen(getenv("PLANTED_MARKER"), "w");
  if (f) { fputs("planted code ran", f); fclose(f); }
}
"""


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    """The wrapper compiler (one replay store for the module) and a planted library."""
    root = tmp_path_factory.mktemp("toolchain")
    real = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    store = root / "store"
    store.mkdir()
    wrapper = root / "bin" / "c++"
    wrapper.parent.mkdir()
    wrapper.write_text(WRAPPER.format(python=sys.executable, real=real, store=str(store)))
    wrapper.chmod(0o755)
    source = root / "planted.c"
    source.write_text(PLANTED_C)
    planted = root / "planted.so"
    subprocess.run([real, "-x", "c", "-shared", "-fPIC", str(source), "-o", str(planted)], check=True)
    return {"cxx": str(wrapper), "planted": planted}


def _child(toolchain, cache: Path, tmp_path: Path, **env: str) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if k not in ("FAKE_MARCH", "FAIL_BUILD")}
    environment |= {
        "CXX": toolchain["cxx"],
        "FUNCTORCH_OPTIM_CACHE": str(cache),
        "BUILD_LOG": str(tmp_path / "builds.log"),
        "PLANTED_MARKER": str(tmp_path / "planted-ran"),
        "JAX_PLATFORMS": "cpu",
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=environment,
        cwd=Path(__file__).parent.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    # a negative code is the signal that killed the process (-7 SIGBUS, -4 SIGILL)
    assert proc.returncode == 0, f"the process died with code {proc.returncode}:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _run(toolchain, cache, tmp_path, **env) -> dict:
    return _result(_child(toolchain, cache, tmp_path, **env))


def _builds(tmp_path: Path) -> int:
    log = tmp_path / "builds.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _verified(library: Path) -> bool:
    checksum = Path(str(library) + ".sha256")
    return hashlib.sha256(library.read_bytes()).hexdigest() == checksum.read_text().strip()


@pytest.fixture(scope="module")
def pristine(toolchain, tmp_path_factory):
    """A cache holding one verified build, made by two processes started together."""
    tmp = tmp_path_factory.mktemp("pristine")
    cache = tmp / "cache"
    procs = [_child(toolchain, cache, tmp) for _ in range(2)]
    results = [_result(p) for p in procs]
    return {"cache": cache, "results": results, "builds": _builds(tmp)}


@pytest.fixture
def cache(pristine, tmp_path):
    """A copy of the pristine cache, and its library's path."""
    copy = tmp_path / "cache"
    shutil.copytree(pristine["cache"], copy)
    (library,) = copy.glob("*.so")
    return copy, library


def test_two_processes_building_at_once_commit_one_whole_library(pristine):
    a, b = pristine["results"]
    assert a["same"] and b["same"] and a["path"] == b["path"]
    assert a["warnings"] == b["warnings"] == []
    # the second waited for the first one's build (the directory lock) and loaded it
    assert pristine["builds"] == 1
    files = sorted(p.name for p in pristine["cache"].iterdir())
    assert files == [Path(a["path"]).name, Path(a["path"]).name + ".sha256"]  # no temporary left
    assert _verified(Path(a["path"]))
    assert stat.S_IMODE(pristine["cache"].stat().st_mode) == 0o700


def test_a_verified_library_loads_without_a_rebuild(toolchain, cache, tmp_path):
    directory, library = cache
    result = _run(toolchain, directory, tmp_path)
    assert result["same"] and result["path"] == str(library) and result["warnings"] == []
    assert _builds(tmp_path) == 0


@pytest.mark.parametrize("size", ["half", "empty"])
def test_a_truncated_library_is_rebuilt(toolchain, cache, tmp_path, size):
    directory, library = cache
    whole = library.read_bytes()
    library.write_bytes(whole[: len(whole) // 2] if size == "half" else b"")
    result = _run(toolchain, directory, tmp_path)
    assert result["same"] and result["path"] == str(library)
    (warning,) = result["warnings"]
    assert str(library) in warning and "does not match the checksum its build recorded" in warning
    assert _builds(tmp_path) == 1 and library.read_bytes() == whole and _verified(library)
    # the next process loads the rebuilt file as it is
    assert _run(toolchain, directory, tmp_path)["warnings"] == [] and _builds(tmp_path) == 1


def test_a_corrupt_library_that_cannot_be_rebuilt_is_a_clear_error(toolchain, cache, tmp_path):
    directory, library = cache
    library.write_bytes(library.read_bytes()[:1000])
    result = _run(toolchain, directory, tmp_path, FAIL_BUILD="1")
    assert result["error"].startswith(f"the cached kernel library {library}: it does not match the checksum")
    assert "rebuilding it failed: building the fused kernel failed" in result["error"]
    assert "this build fails on purpose" in result["error"]
    assert len(library.read_bytes()) == 1000  # left as it was, and never loaded


PLANTS = {
    "without checksum": "has no checksum file beside it",
    "with the old checksum": "does not match the checksum its build recorded",
    "writable by others": "is writable by other users (mode 0o666)",
    "a symbolic link": "a symbolic link is refused",
    "of another user": "is owned by uid 65534, not by this user",
}


@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_library_never_runs(toolchain, cache, tmp_path, plant):
    directory, library = cache
    planted = toolchain["planted"].read_bytes()
    checksum = Path(str(library) + ".sha256")
    if plant == "of another user" and os.geteuid() != 0:
        pytest.skip("creating another user's file needs root")
    if plant == "a symbolic link":
        elsewhere = tmp_path / "elsewhere.so"
        elsewhere.write_bytes(planted)
        library.unlink()
        library.symlink_to(elsewhere)
    else:
        library.write_bytes(planted)
    if plant == "without checksum":
        checksum.unlink()
    elif plant != "with the old checksum":  # a checksum that matches the planted bytes
        checksum.write_text(hashlib.sha256(planted).hexdigest())
    if plant == "writable by others":
        library.chmod(0o666)
    if plant == "of another user":
        os.chown(library, 65534, 65534)
    result = _run(toolchain, directory, tmp_path)
    assert not (tmp_path / "planted-ran").exists(), "the planted library's code ran"
    assert result["same"]
    (warning,) = result["warnings"]
    assert str(library) in warning and PLANTS[plant] in warning and "it is not loaded" in warning
    assert not library.is_symlink() and _verified(library) and library.stat().st_uid == os.geteuid()


@pytest.mark.parametrize("problem", ["writable by others", "of another user"])
def test_a_cache_directory_others_can_write_is_refused(toolchain, cache, tmp_path, problem):
    directory, library = cache
    planted = toolchain["planted"].read_bytes()
    library.write_bytes(planted)
    Path(str(library) + ".sha256").write_text(hashlib.sha256(planted).hexdigest())
    if problem == "writable by others":
        directory.chmod(0o777)
        expected = "is writable by other users (mode 0o777)"
    else:
        if os.geteuid() != 0:
            pytest.skip("creating another user's directory needs root")
        os.chown(directory, 65534, 65534)
        expected = "is owned by uid 65534, not by this user"
    result = _run(toolchain, directory, tmp_path)
    assert not (tmp_path / "planted-ran").exists(), "the planted library's code ran"
    assert result["error"].startswith(f"the fused-kernel cache directory {directory} {expected}")
    assert "FUNCTORCH_OPTIM_CACHE" in result["error"] and "fused=False" in result["error"]
    assert _builds(tmp_path) == 0 and library.read_bytes() == planted  # nothing written there


@X86
def test_a_cache_shared_with_another_cpu_keeps_one_build_per_cpu(toolchain, cache, tmp_path):
    # the same compiler path and flags; on the other machine -march=native means x86-64-v2
    directory, library = cache
    other = _run(toolchain, directory, tmp_path, FAKE_MARCH="x86-64-v2")
    assert other["same"] and other["warnings"] == [] and _builds(tmp_path) == 1
    assert other["path"] != str(library) and _verified(Path(other["path"]))
    # and back on this machine its own build, untouched, loads without a rebuild
    assert _run(toolchain, directory, tmp_path)["path"] == str(library) and _builds(tmp_path) == 1
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", other["path"]], capture_output=True, text=True).stdout
        assert "zmm" not in code  # no AVX-512 in the x86-64-v2 build


@X86
def test_the_key_holds_the_features_the_compiler_resolves():
    compiler = _fused._compiler()
    native = _fused.target_features(compiler, _fused._FLAGS)
    baseline = tuple("-march=x86-64" if f == "-march=native" else f for f in _fused._FLAGS)
    assert native != _fused.target_features(compiler, baseline)
    assert "-march=native" not in native
    assert _fused.library_path(compiler, _fused._FLAGS, native) != _fused.library_path(
        compiler, _fused._FLAGS, _fused.target_features(compiler, baseline)
    )
