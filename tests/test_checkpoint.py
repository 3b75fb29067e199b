"""Whole training checkpoints across torch and JAX, each resume in a fresh process.

A torch run (``Adam`` + ``OneCycleLR`` + ``GradScaler``, float64 MLP) saves
``{"model", "optimizer", "scheduler", "scaler", "epoch"}`` with ``torch.save``; the
facade or the functional optimizer resumes it in a new process and saves its own; torch
resumes that, again in a new process. Every phase reads with ``torch.load``'s default
``weights_only=True``. The phases live in tests/_checkpoint_phases.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import _checkpoint_phases as phases

ROOT = Path(__file__).resolve().parents[1]
A, B, C = 10, 20, 30  # torch 0..A, JAX A..B, torch B..C


def _run(*phases_args):
    """One fresh process running the given phases (each ``(kind, in, out, start, stop)``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    args = [str(a) for phase in phases_args for a in phase]
    cmd = [sys.executable, "-m", "tests._checkpoint_phases", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(f"{phase[2]}.json").read_text()) for phase in phases_args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """torch 0..A; the facade and the functional path each resume that, A..B (a second
    process); torch resumes each of theirs, B..C (a third)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    _, losses, params = phases.torch_phase(None, 0, C)  # uninterrupted, in this process
    out = {"full": {"losses": losses, "params": params}, "dir": tmp}
    (out["torch0"],) = _run(("torch", "-", tmp / "torch0.pt", 0, A))
    kinds = ("facade", "functional")
    jax_runs = _run(*[(k, tmp / "torch0.pt", tmp / f"{k}.pt", A, B) for k in kinds])
    back = _run(*[("torch", tmp / f"{k}.pt", tmp / f"{k}-torch.pt", B, C) for k in kinds])
    for k, mid, last in zip(kinds, jax_runs, back, strict=True):
        out[k], out[f"{k}-torch"] = mid, last
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite)
    return float(np.max(np.abs(a[finite] - b[finite]) / np.maximum(np.abs(b[finite]), 1e-300)))


@pytest.mark.parametrize("kind", ["facade", "functional"])
def test_torch_checkpoint_resumes_in_jax_and_back_in_torch_like_the_uninterrupted_run(runs, kind):
    full = runs["full"]
    losses = runs["torch0"]["losses"] + runs[kind]["losses"] + runs[f"{kind}-torch"]["losses"]
    assert len(losses) == C
    assert _rel(losses, full["losses"]) <= 1e-12
    assert [t for t, v in enumerate(losses) if not np.isfinite(v)] == list(phases.INF_AT)
    final = runs[f"{kind}-torch"]["params"]
    assert list(final) == list(full["params"])  # named_parameters() order
    for name in full["params"]:
        assert _rel(final[name], full["params"][name]) <= 1e-12, name
    assert full["losses"][-1] < full["losses"][0] / 10  # it trains


def test_jax_checkpoint_is_torch_readable_with_weights_only(runs):
    """What the JAX phase wrote: torch tensors and Python values only, torch's layout."""
    ckpt = torch.load(runs["dir"] / "facade.pt", weights_only=True)
    ref = torch.load(runs["dir"] / "torch0.pt", weights_only=True)
    assert set(ckpt) == set(ref) and ckpt["epoch"] == B
    assert list(ckpt["model"]) == list(ref["model"])
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in ckpt["model"].values())
    assert set(ckpt["optimizer"]["state"]) == set(ref["optimizer"]["state"]) == {0, 1, 2, 3}
    for entry in ckpt["optimizer"]["state"].values():
        assert {k: type(v) for k, v in entry.items()} == {"step": torch.Tensor, "exp_avg": torch.Tensor,
                                                          "exp_avg_sq": torch.Tensor}  # fmt: skip
    for key in ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "betas"):
        assert key in ckpt["optimizer"]["param_groups"][0], key  # what OneCycleLR keeps there
    assert set(ckpt["scheduler"]) == set(ref["scheduler"])
    assert {k: type(v) for k, v in ckpt["scaler"].items()} == {k: type(v) for k, v in ref["scaler"].items()}
    assert ckpt["scaler"]["scale"] != ref["scaler"]["scale"]  # it moved in the JAX phase
