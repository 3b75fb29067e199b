"""The command line: the demo trains next to torch and agrees with it."""

from __future__ import annotations

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
