"""The command line: the demo trains next to torch and agrees with it; missing extras get a hint."""

from __future__ import annotations

import pytest

from functorch_optim import _demo
from functorch_optim.__main__ import main


def test_demo_matches_torch_and_loss_falls():
    lines = []
    result = _demo.run(steps=8, every=2, micro_batch=8, hidden=8, print_fn=lines.append)
    assert result["max_rel_diff"] <= 1e-12
    assert result["jax"][-1] < 0.5 * result["jax"][0]
    assert lines[-1].startswith("loss ")


def test_main_demo_exit_code(capsys):
    assert main(["demo", "--steps", "3"]) == 0
    assert "largest relative difference from torch" in capsys.readouterr().out


def _blocked_env(tmp_path, *modules):
    """An environment whose Python cannot import ``modules`` (as if not installed)."""
    import os

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), root])}


@pytest.mark.parametrize(
    ("argv", "blocked", "hint"),
    [
        (["demo", "--steps", "2"], "torch", "pip install 'functorch_optim[torch]'"),
        (
            ["parity", "--quick", "--only", "sgd", "--no-cache"],
            "torch",
            "pip install 'functorch_optim[torch]'",
        ),
        (["bench", "--quick", "--sections", "sgd"], "matplotlib", "pip install matplotlib"),
    ],
    ids=["demo-torch", "parity-torch", "bench-matplotlib"],
)
def test_missing_optional_dependency_prints_an_install_hint(tmp_path, argv, blocked, hint):
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "functorch_optim", *argv],
        env=_blocked_env(tmp_path, blocked),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert f"functorch-optim {argv[0]}: needs {blocked}, which is not installed; {hint}" in run.stderr


def test_an_unrelated_missing_module_is_not_hidden(monkeypatch):
    def broken(**kwargs):
        import functorch_optim_no_such_module  # noqa: F401

    monkeypatch.setattr(_demo, "run", broken)
    with pytest.raises(ModuleNotFoundError, match="functorch_optim_no_such_module"):
        main(["demo"])
