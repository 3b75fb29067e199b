"""The fused kernels come built with the package; only a verified library is loaded, and
without one every optimizer runs its jitted rule after one warning, never an error.

Every case runs in a fresh process on a copy of the installed package (its kernel library
and checksum included), so a crash (SIGBUS from a truncated library, SIGILL, a planted
library's code) is a failed test, not a dead pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from functorch_optim import _fused

X86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 clones")
PACKAGE = Path(_fused.__file__).parent

# The child: fused=True as a user writes it, then three steps of each kernel's optimizer
# (float32 and float64; with "one", AdamW float64 only) against fused=False; prints what
# happened as JSON.
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
        same = True
        cases = [("sgd", dict(momentum=0.9, weight_decay=0.01)), ("adamw", {}),
                 ("adagrad", dict(weight_decay=0.1))]
        dtypes = (jnp.float32, jnp.float64)
        if sys.argv[1] == "one":  # a loading check: one optimizer, one dtype
            cases, dtypes = cases[1:2], dtypes[1:]
        for name, kw in cases:
            for dtype in dtypes:
                params = {"w": jnp.linspace(-1.0, 1.0, 70_000, dtype=dtype)}
                out = []
                for fused in (False, True):
                    tx = getattr(fo, name)(lr=0.1, fused=fused, **kw)
                    step = jax.jit(lambda p, s, k, tx=tx: fo.step(tx, p, {"w": jnp.cos(p["w"] * k)}, s))
                    p, s = params, tx.init(params)
                    for k in range(3):
                        p, s = step(p, s, k + 1.0)
                    out.append(np.asarray(p["w"]).tobytes())
                same = same and out[0] == out[1]
    print(json.dumps({
        "path": _fused.load_kernels(),
        "warnings": [str(w.message) for w in caught],
        "same": same,
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


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def test_the_package_ships_a_verified_kernel_library():
    library = _fused.library_file()
    assert library is not None, "the package was installed without its kernel library"
    assert _fused.load_kernels() == str(library)
    checksum = Path(str(library) + ".sha256")
    assert hashlib.sha256(library.read_bytes()).hexdigest() == checksum.read_text().strip()


@X86
def test_the_library_has_an_avx512_an_avx2_and_a_baseline_clone_of_each_loop():
    if not shutil.which("nm"):
        pytest.skip("needs nm")
    symbols = subprocess.run(["nm", "-C", str(_fused.library_file())], capture_output=True, text=True).stdout
    for loop in ("SgdLoop", "AdamLoop", "AdagradLoop", "AddLoop"):
        lines = [line for line in symbols.splitlines() if f"::{loop}<" in line]
        for clone in ("[clone .arch_x86_64_v4]", "[clone .arch_x86_64_v3]", "[clone .default]"):
            assert any(line.endswith(clone) for line in lines), (loop, clone)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A pristine copy of the installed package, library and checksum included."""
    root = tmp_path_factory.mktemp("installed")
    shutil.copytree(PACKAGE, root / "functorch_optim", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture
def package(installed, tmp_path):
    """A fresh copy of the pristine package, and its library's path."""
    root = tmp_path / "site"
    shutil.copytree(installed, root)
    return root, _fused.library_file(root / "functorch_optim")


def _run(root: Path, tmp_path: Path, cases: str = "one") -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "PLANTED_MARKER": str(tmp_path / "planted-ran"),
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, cases],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # a negative code is the signal that killed the process (-7 SIGBUS, -4 SIGILL)
    assert proc.returncode == 0, f"the process died with code {proc.returncode}:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"], "fused=True and fused=False differ"
    return result


def test_the_copied_package_loads_its_own_library(package, tmp_path):
    root, library = package
    result = _run(root, tmp_path, "all")
    assert result["path"] == str(library) and result["warnings"] == []


def _fallback(result: dict, *parts: str) -> None:
    assert result["path"] is None
    (warning,) = result["warnings"]  # one warning in the process, for every construction and step
    assert "fused CPU kernels are not available" in warning and "fused=False" in warning
    for part in parts:
        assert part in warning


def test_a_package_without_its_library_runs_the_jitted_rule_after_one_warning(package, tmp_path):
    root, library = package
    library.unlink()
    _fallback(_run(root, tmp_path), "there is no kernel library _fused_kernels*.so in")


@pytest.mark.parametrize("size", ["half", "empty"])
def test_a_truncated_library_is_never_loaded(package, tmp_path, size):
    root, library = package
    whole = library.read_bytes()
    library.write_bytes(whole[: len(whole) // 2] if size == "half" else b"")
    _fallback(_run(root, tmp_path), str(library), "does not match the checksum its build recorded")


PLANTS = {
    "without checksum": "has no checksum file beside it",
    "with the old checksum": "does not match the checksum its build recorded",
    "writable by others": "is writable by other users (mode 0o666",
    "a symbolic link": "a symbolic link is refused",
    "of another user": "is owned by uid 65534, not by this package's owner",
}


@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_library_never_runs(package, tmp_path, plant):
    compiler = _compiler()
    if compiler is None:
        pytest.skip("building the planted library needs a C compiler")
    if plant == "of another user" and os.geteuid() != 0:
        pytest.skip("creating another user's file needs root")
    root, library = package
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C)
    built = tmp_path / "planted.so"
    subprocess.run([compiler, "-x", "c", "-shared", "-fPIC", str(source), "-o", str(built)], check=True)
    planted = built.read_bytes()
    checksum = Path(str(library) + ".sha256")
    if plant == "a symbolic link":
        library.unlink()
        library.symlink_to(built)
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
    result = _run(root, tmp_path)
    assert not (tmp_path / "planted-ran").exists(), "the planted library's code ran"
    _fallback(result, str(library), PLANTS[plant])


@X86
@pytest.mark.parametrize("arch", ["x86-64", "x86-64-v3"])
def test_each_clone_is_bit_identical_to_the_jitted_rule(package, tmp_path, arch):
    # this CPU runs the AVX-512 clone; the others' code, built alone for its level, in a
    # library of its own (the baseline has no FMA instruction: std::fma is the C library's)
    compiler = _compiler()
    if compiler is None:
        pytest.skip("building a single-level library needs a C++ compiler")
    import jax

    root, library = package
    command = [compiler, "-std=c++20", "-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]
    command += [f"-march={arch}", "-DFO_CLONES=", "-w", "-I", jax.ffi.include_dir()]
    command += [str(PACKAGE / "_fused_kernels.cc"), "-o", str(library)]
    subprocess.run(command, check=True)
    Path(str(library) + ".sha256").write_text(hashlib.sha256(library.read_bytes()).hexdigest())
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True).stdout
        assert "zmm" not in code and (("vfmadd" in code) == (arch == "x86-64-v3"))
    result = _run(root, tmp_path, "all")
    assert result["path"] == str(library) and result["warnings"] == []


def test_importing_and_building_default_optimizers_never_warns(package, tmp_path):
    # the default (fused=None) loads the library when a step is traced, not before
    root, library = package
    library.unlink()
    code = (
        "import warnings; warnings.simplefilter('error'); import functorch_optim as fo; "
        "fo.sgd(lr=0.1); fo.adamw(lr=0.1); fo.adagrad(lr=0.1); print('quiet')"
    )
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "quiet", run.stderr[-2000:]
