"""The parity report (functorch_optim.parity) and its CLI (python -m functorch_optim parity)."""

from __future__ import annotations

import json

import numpy as np
import optax
import pytest

import functorch_optim as fo
from functorch_optim import parity
from functorch_optim.__main__ import build_parser, main
from functorch_optim._registry import OptimizerSpec, get_spec
from functorch_optim.testing import compare_with_torch

pytest.importorskip("torch")
pytest.importorskip("tqdm")


@pytest.fixture(scope="module")
def quick_sgd():
    """The quick report on SGD, through the CLI, as parsed JSON (run once per module)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["parity", "--no-cache", "--quick", "--json", "--only", "sgd", "--no-progress"])
    return code, json.loads(out.getvalue())


def test_quick_sgd_report_numbers(quick_sgd):
    code, report = quick_sgd
    assert code == 0
    assert report["ok"] is True and report["quick"] is True
    assert report["steps"] == parity.QUICK_STEPS == 20
    assert report["rtol"] == {"float64": 1e-10, "float32": 1e-5}
    rows = report["rows"]
    assert [r["name"] for r in rows] == ["SGD"] * 3
    assert [r["config"] for r in rows] == parity.quick_configs(get_spec("sgd").grid)
    for r in rows:
        assert r["verdict"] == "match" and r["error"] is None
        assert 0.0 <= r["rel_f64"] <= 1e-14
        assert 0.0 <= r["rel_f32"] <= 1e-5
    assert report["summary"] == {
        "rows": 3,
        "match": 3,
        "mismatch": 0,
        "error": 0,
        "optax_rows": 3,
        "optax_exact": 2,
    }


def test_quick_sgd_optax_column(quick_sgd):
    _, report = quick_sgd
    by_damp = {r["config"]["dampening"] > 0 and r["config"]["momentum"] > 0: r for r in report["rows"]}
    damped = by_damp[True]
    # optax has no dampening: it drifts away from torch from step 2 on
    assert damped["optax"] == (
        "optax.chain(optax.scale(-1.0), optax.add_decayed_weights(0.05), optax.sgd(0.1, momentum=0.9))"
    )
    assert damped["optax_rel_f64"] > 1e-2
    others = [r for r in report["rows"] if r is not damped]
    assert all(r["optax_rel_f64"] <= 1e-14 for r in others)


def test_report_numbers_equal_an_independent_comparison(quick_sgd):
    _, report = quick_sgd
    row = report["rows"][1]
    shapes = parity.param_shapes(quick=True)  # the quick rows' one parameter
    params, grads = parity._stream(report["steps"], np.float64, shapes)
    direct = compare_with_torch("sgd", params, grads, **row["config"])
    assert row["rel_f64"] == direct.max_rel
    assert [r.where for r in direct.records if r.step == 1] == [
        "param ['layer']['w']",
        "momentum_buffer ['layer']['w']",
    ]
    params32, grads32 = parity._stream(report["steps"], np.float32, shapes)
    assert row["rel_f32"] == compare_with_torch("sgd", params32, grads32, **row["config"]).max_rel


def _fake(name, override, grid):
    return OptimizerSpec(name, lambda **kw: fo.sgd(**{**kw, **override}), "SGD", ("momentum_buffer",), grid)


def test_mismatch_and_error_rows_exit_nonzero(monkeypatch, capsys):
    specs = (
        _fake("sgd_ok", {}, ({"lr": 0.1, "momentum": 0.9},)),
        _fake("sgd_off", {"dampening": 0.1}, ({"lr": 0.1, "momentum": 0.9},)),
        _fake("sgd_bad", {}, ({"lr": 0.1, "no_such_argument": 1.0},)),
    )
    monkeypatch.setattr(parity, "OPTIMIZERS", specs)
    monkeypatch.setattr(parity, "_scheduler_specs", list)  # optimizer rows only
    code = main(["parity", "--no-cache", "--steps", "3", "--no-progress", "--no-optax", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ok"] is False
    rows = report["rows"]
    assert [r["verdict"] for r in rows] == ["match", "MISMATCH", "ERROR"]
    assert rows[0]["rel_f64"] <= 1e-15
    # dampening 0.1 on one side: step 2's buffer differs by 0.1 * |g2|, far above tolerance
    assert rows[1]["rel_f64"] > 1e-3 and rows[1]["rel_f32"] > 1e-3
    assert "unexpected keyword argument 'no_such_argument'" in rows[2]["error"]
    assert report["summary"] == {
        "rows": 3,
        "match": 1,
        "mismatch": 1,
        "error": 1,
        "optax_rows": 0,
        "optax_exact": 0,
    }


def test_text_report_tables():
    rows = [
        parity.ParityRow(
            "optimizer",
            "SGD",
            {"lr": 0.1, "momentum": 0.0},
            5,
            0.0,
            1e-7,
            "match",
            optax="optax.sgd(0.1)",
            optax_rel_f64=0.0,
        ),
        parity.ParityRow(
            "optimizer",
            "SGD",
            {"lr": 0.1, "momentum": 0.9, "dampening": 0.3},
            5,
            2e-3,
            3e-3,
            "MISMATCH",
            optax="optax.sgd(0.1, momentum=0.9)",
            optax_rel_f64=0.25,
        ),
        parity.ParityRow(
            "optimizer",
            "SGD",
            {"lr": -1.0},
            5,
            None,
            None,
            "ERROR",
            error="ValueError: Invalid learning rate: -1.0",
        ),
    ]
    versions = {"functorch_optim": "0.1.0", "torch": "2.13.0", "jax": "0.10.2", "optax": "0.2.8"}
    result = parity.ParityResult(rows, 5, True, dict(parity.DEFAULT_RTOL), versions, 1.25)
    text = parity.format_report(result, wide=True)
    lines = text.splitlines()
    assert lines[0].startswith("functorch_optim 0.1.0 vs torch 2.13.0 (foreach=False)")
    headers = [line.split("  ") for line in lines if line.startswith("optimizer  ")]
    assert [[h.strip() for h in hs if h.strip()] for hs in headers] == [
        ["optimizer", "config", "steps", "max rel err f64", "max rel err f32", "verdict"],
        ["optimizer", "config", "optax construction", "max rel err f64", "vs torch"],
    ]
    row_lines = [line.split() for line in lines if line.startswith("SGD ")]
    # defaults are left out of the config column (momentum=0.0 is torch's default)
    assert row_lines[0] == ["SGD", "lr=0.1", "5", "0", "1.00e-07", "match"]
    assert row_lines[1][-3:] == ["2.00e-03", "3.00e-03", "MISMATCH"]
    assert row_lines[2] == ["SGD", "lr=-1.0", "5", "-", "-", "ERROR"]
    assert "ERROR SGD(lr=-1.0): ValueError: Invalid learning rate: -1.0" in lines
    assert row_lines[3] == ["SGD", "lr=0.1", "optax.sgd(0.1)", "0", "same", "as", "torch"]
    assert row_lines[4][-2:] == ["2.50e-01", "differs"]
    assert row_lines[5] == ["SGD", "lr=-1.0", "(none", "in", "optax)", "-", "-"]
    assert lines[-1] == (
        "1/3 rows match torch (1 mismatch, 1 error); optax's closest construction matches torch in 1/2; 1.2 s"
    )
    assert result.ok is False
    _check_summary_report(result)


def _check_summary_report(result):
    """The default report of ``test_text_report_tables``' rows: one line per optimizer."""
    text = parity.format_report(result)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    (sgd,) = [line.split() for line in lines if line.startswith("SGD ")]
    # 3 rows, 1 match, largest errors; optax within tolerance in 1 of its 2 rows
    assert sgd == ["SGD", "3", "1", "2.00e-03", "3.00e-03", "1/2", "2.50e-01"]
    worst = lines[lines.index(next(line for line in lines if line.startswith("SGD "))) + 1]
    assert worst == "  worst: lr=-1.0"  # the row that did not run is the worst
    assert (
        "MISMATCH SGD(lr=0.1, momentum=0.9, dampening=0.3): max rel err f64 2.00e-03, f32 3.00e-03" in lines
    )
    assert "ERROR SGD(lr=-1.0): ValueError: Invalid learning rate: -1.0" in lines
    assert lines[-1].endswith("1.2 s")


def test_summary_report_fits_100_columns_and_names_the_worst_config():
    long = {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05, "maximize": True}
    rows = [
        parity.ParityRow(
            "optimizer", "SGD", {"lr": 0.1}, 5, 1e-16, 1e-7, optax="optax.sgd(0.1)", optax_rel_f64=0.0
        ),
        # larger in float32 relative to its tolerance: the worst although f64 is smaller
        parity.ParityRow("optimizer", "SGD", long, 5, 1e-17, 9e-6, optax="optax.sgd(...)", optax_rel_f64=0.5),
        parity.ParityRow("optimizer", "LBFGS", {"max_iter": 1}, 5, 2e-16, 1e-8),
        parity.ParityRow("scheduler", "StepLR", {"step_size": 3}, 5, 0.0),
        parity.ParityRow("scheduler", "StepLR", {"step_size": 3, "gamma": 0.5}, 5, 1e-16),
    ]
    versions = {"functorch_optim": "0.1.0", "torch": "2.13.0", "jax": "0.10.2", "optax": "0.2.8"}
    result = parity.ParityResult(rows, 5, False, dict(parity.DEFAULT_RTOL), versions, 3.0)
    lines = parity.format_report(result).splitlines()
    assert max(len(line) for line in lines) <= 100
    table = {
        line.split()[0]: line.split()
        for line in lines
        if line.split() and line.split()[0] in ("SGD", "LBFGS", "StepLR")
    }
    assert table["SGD"] == ["SGD", "2", "2", "1.00e-16", "9.00e-06", "1/2", "5.00e-01"]
    assert table["LBFGS"] == ["LBFGS", "1", "1", "2.00e-16", "1.00e-08", "-", "-"]
    assert table["StepLR"] == ["StepLR", "2", "2", "1.00e-16"]
    worst = [line.strip() for line in lines if line.strip().startswith("worst:")]
    assert worst == [
        "worst: lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.05, maximize=True",
        "worst: max_iter=1",
        "worst: step_size=3, gamma=0.5",
    ]
    assert "rows that do not match torch:" not in lines
    wide = parity.format_report(result, wide=True).splitlines()
    assert sum(line.startswith("SGD ") for line in wide) == 4  # both rows, in both wide tables


def test_compiled_steps_are_shared_without_changing_numbers():
    spec = get_spec("sgd")
    # (the same zero-ness: a dampening number of 0 with a buffer is compiled in)
    configs = [
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1},
        {"lr": 0.01, "momentum": 0.5, "dampening": 0.3},
    ]
    cache = parity._StepCache()
    rows = [parity._optimizer_row(spec, c, 5, cache, None, parity.DEFAULT_RTOL) for c in configs]
    assert len(cache.fns) == 1  # one structure (momentum buffer, no nesterov/maximize)
    params, grads = parity._stream(5, np.float64)
    for row, c in zip(rows, configs, strict=True):
        assert row.rel_f64 == compare_with_torch("sgd", params, grads, **c).max_rel


@pytest.mark.parametrize(
    ("spec", "quick", "expected"),
    [
        (None, False, parity.PARAM_SHAPES),
        (None, True, {"layer": {"w": (3, 4)}}),
        ("muon", False, {"w": (3, 4), "tall": (5, 3), "square": (4, 4)}),
        ("muon", True, {"w": (3, 4)}),
        ((), True, ()),  # a spec whose one parameter is a 0-d scalar keeps it
    ],
    ids=["full", "quick", "muon-full", "muon-quick", "scalar-quick"],
)
def test_param_shapes_quick_keeps_the_first_parameter(spec, quick, expected):
    import types

    if isinstance(spec, str):
        spec = get_spec(spec)
    elif spec is not None:
        spec = types.SimpleNamespace(shapes=spec)
    assert parity.param_shapes(spec, quick) == expected


def test_quick_configs_cover_every_value():
    grid = get_spec("sgd").grid
    chosen = parity.quick_configs(grid)
    assert len(chosen) == 3
    for key in grid[0]:
        assert {repr(c[key]) for c in chosen} == {repr(c[key]) for c in grid}, key
    assert parity.quick_configs([]) == []
    assert parity.quick_configs(grid, limit=1) == [dict(grid[0])]


def test_optax_closest_constructions_are_valid_optax():
    import jax.numpy as jnp

    configs = {
        "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
        "Adam": {"lr": 0.1, "amsgrad": True, "weight_decay": 0.1, "decoupled_weight_decay": True},
        "AdamW": {"lr": 0.1},
        "Adagrad": {"lr": 0.1, "lr_decay": 0.01},
        "RMSprop": {"lr": 0.1, "momentum": 0.9, "centered": True},
        "Adadelta": {"weight_decay": 0.1},
        "Adamax": {},
        "NAdam": {"decoupled_weight_decay": True, "weight_decay": 0.1},
        "RAdam": {"decoupled_weight_decay": True, "weight_decay": 0.1},
        "Rprop": {"etas": (0.4, 1.3)},
        "ASGD": {"maximize": True},
    }
    assert set(configs) == set(parity.OPTAX_CLOSEST)
    params = {"w": jnp.ones(2)}
    for name, config in configs.items():
        text, tx = parity.OPTAX_CLOSEST[name](config)
        assert text.startswith("optax."), name
        tx.init(params)
    # a chain that must keep torch's order: negate, then L2, then the optimizer
    text, tx = parity.OPTAX_CLOSEST["SGD"]({"lr": 0.5, "weight_decay": 0.1, "maximize": True})
    assert text == "optax.chain(optax.scale(-1.0), optax.add_decayed_weights(0.1), optax.sgd(0.5))"
    updates, _ = tx.update({"w": jnp.full(2, 2.0)}, tx.init(params), params)
    assert updates["w"].tolist() == [-0.5 * (-2.0 + 0.1)] * 2


def test_parser_has_the_parity_subcommand():
    args = build_parser().parse_args(["parity", "--quick", "--json"])
    assert args.command == "parity" and args.quick and args.json and args.func is parity.cli
    assert args.workers is None  # run_parity's default_workers()
    assert build_parser().parse_args(["parity", "--workers", "3"]).workers == 3
    assert 1 <= parity.default_workers() <= 8
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_unknown_only_name_exits_2(capsys):
    assert main(["parity", "--no-cache", "--only", "nope", "--no-progress"]) == 2
    assert "nothing by these names; known: sgd" in capsys.readouterr().err


def _step_lr(lr, step_size, gamma=0.1):
    """StepLR in closed form, ``count -> lr``."""
    return lambda count: lr * gamma ** (int(count) // step_size)


class _Values:
    def __init__(self, lr, gamma):
        self.lr, self.gamma = lr, gamma

    def values(self, n):
        out = [self.lr]
        for _ in range(n):
            out.append(out[-1] * self.gamma)
        return np.asarray(out)


def _exponential_lr(gamma, *, lr):
    """ExponentialLR with ``lr`` keyword-only (like one_cycle_lr) and a ``values`` method."""
    return _Values(lr, gamma)


def test_scheduler_rows(monkeypatch):
    specs = [
        parity.SchedulerSpec("StepLR", _step_lr, ({"step_size": 3, "gamma": 0.5},)),
        parity.SchedulerSpec("ExponentialLR", _exponential_lr, ({"gamma": 0.9},)),
        parity.SchedulerSpec("ExponentialLR", lambda lr, gamma: _Values(lr, gamma * 1.01), ({"gamma": 0.9},)),
    ]
    monkeypatch.setattr(parity, "_scheduler_specs", lambda: specs)
    result = parity.run_parity(only=["ExponentialLR", "StepLR"], steps=12, progress=False)
    assert [r.kind for r in result.rows] == ["scheduler"] * 3
    assert [r.verdict for r in result.rows] == ["match", "match", "MISMATCH"]
    assert result.rows[0].rel_f64 <= 1e-15 and result.rows[1].rel_f64 <= 1e-15
    # gamma * 1.01: lr_t is 0.1 * 0.9**t * 1.01**t against torch's 0.1 * 0.9**t; scale 0.1
    expected = max(0.9**t * (1.01**t - 1) for t in range(13))
    assert result.rows[2].rel_f64 == pytest.approx(expected, rel=1e-9)
    text = parity.format_report(result, wide=True)
    assert "learning-rate schedulers vs torch.optim.lr_scheduler" in text
    assert [line.split()[:2] for line in text.splitlines() if line.startswith("StepLR")] == [
        ["StepLR", "step_size=3,"]
    ]


def test_scheduler_rows_take_their_steps_in_one_program(monkeypatch):
    from functorch_optim import schedules

    def broken(lr, step_size):
        raise ValueError("no schedule today")

    specs = [
        parity.SchedulerSpec("StepLR", schedules.step_lr, ({"step_size": 3, "gamma": 0.5}, {"step_size": 7})),
        parity.SchedulerSpec("StepLR", broken, ({"step_size": 3},)),
        parity.SchedulerSpec(
            "CosineAnnealingLR", schedules.cosine_annealing_lr, ({"T_max": 7, "eta_min": 0.01},)
        ),
    ]
    monkeypatch.setattr(parity, "_scheduler_specs", lambda: specs)
    with parity._count_programs() as programs:
        result = parity.run_parity(only=["StepLR", "CosineAnnealingLR"], steps=20, progress=False)
    assert [r.verdict for r in result.rows] == ["match", "match", "ERROR", "match"]
    assert result.rows[2].error == "ValueError: no schedule today"
    assert programs.built["jit(scan)"] == 1  # the three schedules' scans: one program
    for row in (result.rows[0], result.rows[1], result.rows[3]):
        spec = next(s for s in specs if s.torch_name == row.name and s.factory is not broken)
        alone = parity._scheduler_row(spec, row.config, 20, parity.DEFAULT_RTOL)
        assert (alone.verdict, alone.rel_f64) == (row.verdict, row.rel_f64)


def test_scheduler_grid_is_valid_for_torch():
    import torch

    for name, (factory_name, grid) in parity.SCHEDULER_GRID.items():
        assert factory_name.islower()
        for config in grid:
            lrs = parity._torch_lrs(name, config, 0.1, 3)
            assert len(lrs) == 4 and all(np.isfinite(lrs)), name
    assert hasattr(torch.optim.lr_scheduler, "OneCycleLR")


def test_schedulers_are_picked_up_when_the_module_exists():
    import importlib.util

    specs = parity._scheduler_specs()
    if importlib.util.find_spec("functorch_optim.schedules") is None:
        assert specs == []
    else:
        assert {s.torch_name for s in specs} <= set(parity.SCHEDULER_GRID) | {s.torch_name for s in specs}
        assert specs


def test_cli_compilation_cache_keeps_the_numbers(tmp_path, quick_sgd):
    # the CLI keeps XLA's compiled steps in $FUNCTORCH_OPTIM_CACHE/xla; the rows are the same
    import os
    import subprocess
    import sys

    env = {**os.environ, "FUNCTORCH_OPTIM_CACHE": str(tmp_path)}
    argv = [sys.executable, "-m", "functorch_optim", "parity", "--quick", "--json", "--only", "sgd"]
    run = subprocess.run([*argv, "--no-progress"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    cached = json.loads(run.stdout)
    assert any((tmp_path / "xla").iterdir())
    keys = ("config", "rel_f64", "rel_f32", "optax_rel_f64", "verdict")
    assert [[r[k] for k in keys] for r in cached["rows"]] == [
        [r[k] for k in keys] for r in quick_sgd[1]["rows"]
    ]


def test_torch_threads_are_restored():
    import torch

    before = torch.get_num_threads()
    with parity._torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def _sgd_spec(name, grid, factory=fo.sgd):
    return OptimizerSpec(name, factory, "SGD", ("momentum_buffer",), grid)


def test_an_optimizers_rows_compile_one_program_with_a_slot_per_step():
    # two structures (with and without a momentum buffer), two configs each: numbers are
    # data (the same zero-ness: a weight_decay or momentum number of 0 is compiled in,
    # and with a buffer a dampening number of 0)
    configs = [
        {"lr": 0.1, "weight_decay": 0.2},
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1},
        {"lr": 0.01, "weight_decay": 0.05},
        {"lr": 0.01, "momentum": 0.5, "dampening": 0.3},
    ]
    spec = _sgd_spec("sgd", tuple(configs))
    batch = parity._BatchedSteps(spec, configs, 4)
    with parity._count_programs() as programs:
        rows = [parity._optimizer_row(spec, c, 4, batch, None, parity.DEFAULT_RTOL) for c in configs]
    # one program for every row and both dtypes; no program per row
    assert programs.built["jit(parity_steps)"] == 1
    assert programs.built["jit(parity_step)"] == 0
    assert sorted(batch.slots) == [
        [(0, "float32"), (2, "float32")],
        [(0, "float64"), (2, "float64")],
        [(1, "float32"), (3, "float32")],
        [(1, "float64"), (3, "float64")],
    ]
    # the same numbers as each configuration on its own
    for row, c in zip(rows, configs, strict=True):
        assert row.verdict == "match"
        for dtype, rel in ((np.float64, row.rel_f64), (np.float32, row.rel_f32)):
            params, grads = parity._stream(4, dtype)
            assert rel == compare_with_torch("sgd", params, grads, **c).max_rel


def _exploding_sgd(**config):
    """SGD whose step cannot be traced when maximize=True (its init works)."""
    tx = fo.sgd(**config)
    if not config.get("maximize"):
        return tx

    def update(grads, state, params=None):
        raise ValueError("boom")

    return optax.GradientTransformation(tx.init, update)


def test_a_failing_step_errors_its_own_row_only():
    configs = [{"lr": 0.1}, {"lr": 0.1, "maximize": True}, {"lr": 0.1, "no_such_argument": 1}]
    spec = _sgd_spec("sgd", tuple(configs), _exploding_sgd)
    batch = parity._BatchedSteps(spec, configs, 3)
    rows = [parity._optimizer_row(spec, c, 3, batch, None, parity.DEFAULT_RTOL) for c in configs]
    assert [r.verdict for r in rows] == ["match", "ERROR", "ERROR"]
    assert rows[1].error == "ValueError: boom"
    assert "unexpected keyword argument 'no_such_argument'" in rows[2].error
    params, grads = parity._stream(3, np.float64)
    assert rows[0].rel_f64 == compare_with_torch("sgd", params, grads, lr=0.1).max_rel


def test_rows_are_the_same_on_one_thread_and_on_several():
    kwargs = {"only": ["sgd", "adamax", "step_lr"], "quick": True, "steps": 3, "progress": False}
    one = parity.run_parity(workers=1, **kwargs)
    three = parity.run_parity(workers=3, **kwargs)
    assert (one.workers, three.workers) == (1, 3)
    keys = ("kind", "name", "config", "rel_f64", "rel_f32", "verdict", "optax_rel_f64")
    assert [[getattr(r, k) for k in keys] for r in one.rows] == [
        [getattr(r, k) for k in keys] for r in three.rows
    ]
    assert [r.name for r in one.rows][-1] == "StepLR" and one.ok
    # no persistent cache here: every program is compiled, and counted
    assert one.compiled > 0 and one.cache_loaded == 0
    with pytest.raises(ValueError, match="workers must be an integer >= 1, got 0"):
        parity.run_parity(workers=0, **kwargs)


def test_optax_rows_of_an_optimizer_step_in_one_program_with_the_numbers_of_each_on_its_own():
    configs = [
        {"lr": 0.1, "weight_decay": 0.2},
        {"lr": 0.1, "momentum": 0.9},
        {"lr": 0.01, "momentum": 0.5, "dampening": 0.3},
    ]
    spec = _sgd_spec("sgd", tuple(configs))
    side = parity._OptaxSteps(spec, configs, 4)
    with parity._count_programs() as programs:
        rows = [
            parity._optimizer_row(spec, c, 4, parity._StepCache(), side, parity.DEFAULT_RTOL) for c in configs
        ]
    assert programs.built["jit(optax_steps)"] == 1
    for row, c in zip(rows, configs, strict=True):
        text, tx = parity.optax_closest(spec, c)
        params, grads = parity._stream(4, np.float64)
        alone = parity._OptaxRunner(tx, params)
        report = parity._run(
            spec, c, "float64", alone, parity._TorchRunner(spec, c, params), parity._GradFeed(grads), ()
        )
        assert row.optax == text
        # jitted or op by op: equal up to a contraction XLA may make (1e-16 relative)
        np.testing.assert_allclose(row.optax_rel_f64, report.max_rel, rtol=1e-12, atol=1e-15)
    # optax has no dampening: the third row drifts, the others follow torch
    assert rows[2].optax_rel_f64 > 1e-3 and max(rows[0].optax_rel_f64, rows[1].optax_rel_f64) <= 1e-14


def test_an_optax_construction_that_fails_marks_its_own_row_only(monkeypatch):
    configs = [{"lr": 0.1}, {"lr": 0.2}]
    spec = _sgd_spec("sgd", tuple(configs))

    def closest(spec, config):
        if config["lr"] == 0.2:
            raise ValueError("no optax for this")
        return "optax.sgd(0.1)", optax.sgd(0.1)

    monkeypatch.setattr(parity, "optax_closest", closest)
    side = parity._OptaxSteps(spec, configs, 3)
    rows = [
        parity._optimizer_row(spec, c, 3, parity._StepCache(), side, parity.DEFAULT_RTOL) for c in configs
    ]
    assert rows[0].optax == "optax.sgd(0.1)" and rows[0].optax_rel_f64 <= 1e-15
    assert rows[1].optax == "optax (failed: ValueError: no optax for this)"
    assert rows[1].optax_rel_f64 is None
    assert [r.verdict for r in rows] == ["match", "match"]
