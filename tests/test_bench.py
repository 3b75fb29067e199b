"""Smoke test of ``python -m functorch_optim bench``: a tiny run, every row has numbers."""

from __future__ import annotations

import json
import math

import pytest

from functorch_optim.__main__ import main
from functorch_optim._bench import STEP_KINDS

pytest.importorskip("torch")
pytest.importorskip("matplotlib")


def _finite_positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "bench",
        "--quick",
        "--reps",
        "2",
        "--sizes",
        "2e4x1",
        "2e4x4",
        "--compile-leaves",
        "2",
        "4",
        "--json",
        str(out / "bench.json"),
        "--plot",
        str(out / "bench.png"),
        "--markdown",
        str(out / "bench.md"),
    ]
    assert main(argv) == 0
    return {
        "json": json.loads((out / "bench.json").read_text()),
        "png": (out / "bench.png").read_bytes(),
        "md": (out / "bench.md").read_text(),
    }


def test_step_rows_have_a_time_and_bandwidth_for_every_contender(result):
    data = result["json"]
    for kind in STEP_KINDS:
        rows = data[kind]
        assert [(r["params"], r["leaves"]) for r in rows] == [(20_000, 1), (20_000, 4)]
        # torch has no fused RMSprop (functorch_optim's kernel is its default path)
        torch_fused = kind != "rmsprop"
        expected = {"optax", "torch foreach", "ceiling jax", "ceiling torch", "functorch_optim"}
        expected |= {"fo fused", "fo fused=False", "fo via update"} | (
            {"torch fused"} if torch_fused else set()
        )
        for row in rows:
            # the flat layout is timed where there is more than one leaf to pack
            names = expected | ({"fo flat"} if row["leaves"] > 1 else set())
            assert set(row["times_ms"]) == names
            assert all(_finite_positive(v) for v in row["times_ms"].values())
            assert set(row["gbps"]) == names
            assert all(_finite_positive(v) for v in row["gbps"].values())
            assert _finite_positive(row["ceiling_gbps"])
            assert row["ceiling_gbps"] == max(row["gbps"]["ceiling jax"], row["gbps"]["ceiling torch"])
            # peak memory of a donated step: params + grads + state (plain SGD: 2; SGD
            # momentum, Adagrad sum: 3; Adam, AdamW: 4)
            floor = {"adam": 4.0, "adamw": 4.0, "sgd_plain": 2.0}.get(kind, 3.0)
            assert floor <= row["memory_x_params"]["optax"] < floor + 0.1
            for name in ("functorch_optim", "fo fused", "fo fused=False"):
                assert floor <= row["memory_x_params"][name] < floor + 0.1, name
            # through update on given gradients: the rule, or (below COPY_LIMIT elements on
            # a CPU where the rule emulates its FMAs) the kernel on XLA's copy of them
            assert floor <= row["memory_x_params"]["fo via update"] < floor + 1.1
            ratios = ("fo/optax", "fo via update/optax", "fo/torch foreach", "fo fused/optax")
            ratios += ("fo fused=False/optax",)
            if torch_fused:
                ratios += ("fo/torch fused", "fo fused/torch fused", "fo fused=False/torch fused")
            for ratio in ratios:
                assert _finite_positive(row["ratios"][ratio]), ratio


def test_accumulate_rows_have_every_contender(result):
    rows = result["json"]["accumulate"]
    assert len(rows) == 2
    layouts = ("fo", "fo fused", "fo flat")
    kinds = ("micro", "weighted micro", "window", "plain")
    steps = {f"{prefix} {kind} step" for prefix in layouts for kind in kinds}
    steps |= {f"{prefix} passthrough acc+g" for prefix in layouts}
    names = steps | {
        "bare acc+g",
        "bare flat acc+g",
        "bare acc+w*g",
        "bare flat acc+w*g",
        "optax MultiSteps micro-step",
        "torch grad.add_",
        "ceiling jax",
        "ceiling torch",
    }
    for row in rows:
        assert set(row["times_ms"]) == names
        assert all(_finite_positive(v) for v in row["times_ms"].values())
        window_parts = {f"{prefix} (window - micro)/plain" for prefix in layouts}
        assert window_parts < set(row["ratios"])
        assert {f"{prefix} weighted micro/bare" for prefix in layouts} < set(row["ratios"])
        assert {f"{prefix} micro/passthrough" for prefix in layouts} < set(row["ratios"])
        # a difference of two noisy times: finite, not necessarily positive
        assert all(math.isfinite(row["ratios"][k]) for k in window_parts)
        assert all(_finite_positive(v) for k, v in row["ratios"].items() if k not in window_parts)
        # one accumulator on top of params + grads + momentum buffer, nothing more, in
        # every layout (the fused window call writes the mean over the accumulated sum)
        for prefix in layouts:
            for name in (f"{prefix} micro step", f"{prefix} window step", f"{prefix} passthrough acc+g"):
                assert 4.0 <= row["memory_x_params"][name] < 4.1, name
        assert 2.0 <= row["memory_x_params"]["bare acc+g"] < 2.1
        assert 2.0 <= row["memory_x_params"]["bare flat acc+g"] < 2.1
    md = result["md"]
    assert "| 20k | 4 | tree, fused=True |" in md and "| 20k | 4 | flat, fused=True |" in md


def test_compile_rows_and_outputs(result):
    rows = result["json"]["compile"]
    assert [r["leaves"] for r in rows] == [2, 4]
    for row in rows:
        expected = {
            "fo sgd",
            "fo sgd flat",
            "fo adam flat",
            "fo grad_accumulate flat",
            "optax sgd",
            "fo grad_accumulate",
            "fo grad_accumulate fused",
            "optax MultiSteps",
            "optax adam",
        }
        assert expected <= set(row["seconds"])
        assert all(_finite_positive(v) for v in row["seconds"].values())
    assert result["png"][:8] == b"\x89PNG\r\n\x1a\n"
    md = result["md"]
    assert "| sgd | 20k | 1 |" in md and "| adam | 20k | 4 |" in md and "| adagrad | 20k | 4 |" in md
    assert "### Compile time" in md
    assert result["json"]["meta"]["reps"] == 2


def test_torch_follows_jax_onto_its_device(monkeypatch):
    import torch

    from functorch_optim import _bench

    assert _bench._torch().device == "cpu"  # this machine: JAX on the CPU
    monkeypatch.setattr(_bench.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _bench._torch() is None  # no like-for-like torch rows for a GPU JAX run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    side = _bench._torch()
    assert side.device == "cuda"
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    side.timed(lambda: calls.append("step"))()
    assert calls == ["step", "sync"]  # a CUDA step is timed until the device is done


def test_targets_check_the_default_and_the_jitted_rule_against_optax_on_every_step_row(result):
    from functorch_optim._bench import targets

    found = {
        t["layout"]: t for t in targets(result["json"]) if t["target"] == "0. step / optax (every step row)"
    }
    assert set(found) == {"tree, default", "tree, default via update", "tree, fused=False"}
    for layout, name in (
        ("tree, default", "functorch_optim"),
        ("tree, default via update", "fo via update"),
        ("tree, fused=False", "fo fused=False"),
    ):
        rows = [r for k in STEP_KINDS for r in result["json"][k]]
        worst = max(r["times_ms"][name] / r["times_ms"]["optax"] for r in rows)
        assert found[layout]["worst"] == pytest.approx(worst)
        assert found[layout]["holds"] == (worst <= 1.0)
    assert "0. step / optax (every step row)" in result["md"]


def test_median_interval_is_the_order_statistics_with_the_binomial_coverage():
    import numpy as np

    from functorch_optim._bench import median_interval

    xs = [float(x) for x in range(15, 0, -1)]
    # n = 15: x(4) and x(12), coverage 1 - 2 P(B <= 3) = 0.965 (x(5), x(11): 0.882)
    assert median_interval(xs) == (4.0, 12.0)
    assert median_interval(xs[:6]) == (10.0, 15.0)  # n = 6: the extremes, coverage 0.969
    assert median_interval(xs[:5]) is None  # n = 5: the extremes cover only 0.9375
    # the coverage it claims, on samples of a skewed distribution whose median is 1
    rng = np.random.default_rng(0)
    inside = [lo <= 1.0 <= hi for lo, hi in (median_interval(rng.lognormal(0, 0.5, 15)) for _ in range(4000))]
    assert 0.95 <= np.mean(inside) <= 0.98


def test_paired_ratio_cancels_what_slows_a_whole_rep():
    import numpy as np

    from functorch_optim._bench import paired_ratio

    # the machine slows down by up to 3x from rep to rep; "a" is always 1.1x "b"
    load = np.random.default_rng(1).uniform(1.0, 3.0, 15)
    timings = {"a": {"samples_s": list(1.1e-3 * load)}, "b": {"samples_s": list(1e-3 * load)}}
    q = paired_ratio(timings, "a", "b")
    assert q["reps"] == 15
    assert (
        q["median"] == pytest.approx(1.1)
        and q["low"] == pytest.approx(1.1)
        and q["high"] == pytest.approx(1.1)
    )
    # medians of unpaired samples taken under that load could not tell 1.1 from 1
    shuffled = {"a": timings["a"], "b": {"samples_s": list(1e-3 * load[::-1])}}
    spread = paired_ratio(shuffled, "a", "b")
    assert spread["low"] < 1.0 < spread["high"]
    assert paired_ratio(timings, "a", "missing") is None


def test_paired_ratios_reach_the_rows_targets_and_report():
    from functorch_optim._bench import markdown, targets

    row = {
        "algorithm": "sgd",
        "params": 10**6,
        "leaves": 1,
        "times_ms": {"functorch_optim": 1.0, "fo fused=False": 1.2, "optax": 1.1},
        "fraction_of_ceiling": {},
        "gbps": {},
        "ceiling_gbps": 1.0,
        "memory_x_params": {},
        "ratios": {"fo/torch fused": None},
        "paired": {
            "fo/optax": {"median": 0.9, "low": 0.85, "high": 0.95, "reps": 15},
            "fo via update/optax": {"median": 0.95, "low": 0.91, "high": 0.99, "reps": 15},
            "fo fused=False/optax": {"median": 1.08, "low": 1.02, "high": 1.12, "reps": 15},
        },
    }
    found = {
        t["layout"]: t for t in targets({"sgd": [row]}) if t["target"].startswith("0. step / optax, paired")
    }
    assert found["tree, default"]["worst"] == 0.85 and found["tree, default"]["holds"]
    assert found["tree, default via update"]["worst"] == 0.91
    assert found["tree, fused=False"]["worst"] == 1.02 and not found["tree, fused=False"]["holds"]
    meta = {
        "machine": "m",
        "jax": "j",
        "optax": "o",
        "torch": "t",
        "reps": 15,
        "load_before": 1,
        "load_after": 1,
    }
    md = markdown({"sgd": [row], "meta": {**meta, "wall_s": 1.0}})
    assert "| sgd | 1M | 1 | 15 | 0.90 (0.85–0.95) | 0.95 (0.91–0.99) | 1.08 (1.02–1.12) |" in md
    # a result written before the pairing: no such table, no such target
    del row["paired"]
    assert "paired per rep" not in markdown({"sgd": [row], "meta": {**meta, "wall_s": 1.0}})
    assert not [t for t in targets({"sgd": [row]}) if "paired" in t["target"]]


@pytest.mark.parametrize("kind", ["sgd", "adam", "adagrad", "sgd_plain", "adamw", "rmsprop"])
def test_the_default_contender_is_the_library_default(kind):
    """The "functorch_optim" column is what ``fo.<optimizer>(...)`` gives with only the
    bench's hyperparameters: the same program as the library's default (the kernel for a
    leaf of 20k elements where the kernels load), not ``fused=False``'s."""
    import jax
    import jax.numpy as jnp

    import functorch_optim as fo
    from functorch_optim import _bench, _fused

    make, _, _, kwargs = _bench.STEP_KINDS[kind]
    params = {"w": jnp.full((20_000,), 0.5, jnp.float32)}

    def program(tx):
        return jax.jit(_bench.fo_step_fn(tx)).lower(params, params, tx.init(params)).as_text()

    default = program(getattr(fo, {"sgd_plain": "sgd"}.get(kind, kind))(**kwargs))
    assert program(make()) == default
    if _fused.load_kernels() is not None:
        assert "custom_call" in default and "custom_call" not in program(make(fused=False))


@pytest.mark.parametrize("layout", ["jax_tree", "flat_tree"])
@pytest.mark.parametrize("fused", [None, False, True])
def test_passthrough_computes_what_a_micro_step_does(layout, fused):
    """The micro-step's floor does the micro-step's work on the same arrays: it returns
    the parameters untouched and the accumulator the micro-step writes (bit for bit), so
    the ratio of the two times is the cost of the micro-step's decisions alone."""
    import jax
    import numpy as np

    import functorch_optim as fo
    from functorch_optim import _bench
    from tests.helpers import assert_bitwise_equal

    pack = getattr(_bench, layout)
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal(n).astype(np.float32) for n in (7, 30, 1)]
    tx = fo.grad_accumulate(_bench.fo_sgd(fused=fused), every=_bench.NEVER)
    params, state = pack(leaves), tx.init(pack(leaves))
    floor = jax.jit(_bench.passthrough_acc_add)
    step = jax.jit(_bench.fo_step_fn(tx))
    p_floor, s_floor = params, state
    for _ in range(3):
        grads = pack([rng.standard_normal(x.shape).astype(np.float32) for x in leaves])
        p_floor, s_floor = floor(p_floor, grads, s_floor)
        params, state = step(params, grads, state)
        # the micro-step's first call overwrites the (zero) sum; later calls add in
        for a, b in zip(
            jax.tree.leaves((p_floor, s_floor.acc_grads)), jax.tree.leaves((params, state.acc_grads))
        ):
            assert_bitwise_equal(a, b)
    assert int(state.mini_step) == 3 and not bool(state.stepped)


def test_round_robin_times_every_contender_after_changing_neighbours():
    # a contender always timed right after the same one (torch's, whose threads still
    # spin) would carry that neighbour's cost in every rep
    from functorch_optim._bench import Contender, time_round_robin

    calls = []
    contenders = [Contender(name, lambda name=name: calls.append(name)) for name in "abcde"]
    timings = time_round_robin(contenders, reps=12, warmup=0, settle=1)
    assert sorted(timings) == list("abcde")
    assert all(_finite_positive(t["median_s"]) for t in timings.values())
    # each rep: every contender twice in a row (settle, then timed), in some order
    reps = [calls[i : i + 10] for i in range(0, len(calls), 10)]
    assert len(reps) == 12 and all(r[0::2] == r[1::2] and sorted(r[0::2]) == list("abcde") for r in reps)
    orders = [tuple(r[0::2]) for r in reps]
    predecessors = {c: {o[o.index(c) - 1] for o in orders if o.index(c) > 0} for c in "abcde"}
    assert all(len(p) >= 2 for p in predecessors.values())
    # the same orders in every run
    calls.clear()
    time_round_robin(contenders, reps=12, warmup=0, settle=1)
    assert [tuple(calls[i : i + 10][0::2]) for i in range(0, len(calls), 10)] == orders


def test_round_robin_samples_fill_the_minimum_sample_time(monkeypatch):
    # a sample of a short step is the mean of consecutive calls that fill min_sample_s
    # (by the last warm-up call's time, at most 64); one call where prepare must precede
    from functorch_optim import _bench
    from functorch_optim._bench import Contender, time_round_robin

    clock = [0.0]
    monkeypatch.setattr(_bench.time, "perf_counter", lambda: clock[0])
    calls = {"short": 0, "long": 0, "tiny": 0, "prepared": 0}

    def step(name, seconds):
        def run():
            calls[name] += 1
            clock[0] += seconds

        return run

    contenders = [
        Contender("short", step("short", 0.001)),
        Contender("long", step("long", 0.02)),
        Contender("tiny", step("tiny", 1e-6)),
        Contender("prepared", step("prepared", 0.001), prepare=lambda: None),
    ]
    timings = time_round_robin(contenders, reps=3, warmup=2, settle=1, min_sample_s=0.005)
    # warm-up 2, then per rep one settling call and a sample of 5, 1, 64 and 1 calls
    assert calls == {"short": 2 + 3 * 6, "long": 2 + 3 * 2, "tiny": 2 + 3 * 65, "prepared": 2 + 3 * 2}
    assert timings["short"]["median_s"] == pytest.approx(0.001)
    assert timings["tiny"]["median_s"] == pytest.approx(1e-6)


def test_torch_compile_is_timed_with_a_fresh_inductor_cache(monkeypatch):
    # a cache left by an earlier run would make torch.compile's "compile time" a cache hit
    import os

    from functorch_optim._bench_train import cold_inductor_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_earlier_run")
    with cold_inductor_cache() as first:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == first
        assert os.path.isdir(first) and not os.listdir(first)
    with cold_inductor_cache() as second:
        assert second != first and not os.listdir(second)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/torchinductor_earlier_run"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with cold_inductor_cache():
        pass
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_every_compile_is_timed_cold_traced_and_lowered_again():
    # a compile that reuses an earlier round's trace (the package's per-shape rule is a
    # nested jit, cached across steps) is timed partly warm; each timed compile must
    # trace its program afresh, as the first compile of a user's process does
    import jax
    import jax.numpy as jnp

    from functorch_optim._bench import cold_compile_seconds, compile_seconds

    traces = []

    @jax.jit
    def inner(x):
        traces.append("inner")
        return x * 2

    def outer(x):
        traces.append("outer")
        return inner(x) + 1

    x = jnp.ones(3)
    compile_fn = lambda: jax.jit(outer).lower(x).compile()
    assert cold_compile_seconds(compile_fn) > 0
    assert cold_compile_seconds(compile_fn) > 0
    assert traces == ["outer", "inner"] * 2
    traces.clear()
    seconds = compile_seconds({"a": compile_fn, "b": compile_fn}, rounds=3)
    assert set(seconds) == {"a", "b"} and all(s > 0 for s in seconds.values())
    # the warm-up compiles may hit the caches the last call filled; every timed one traces
    assert traces[-12:] == ["outer", "inner"] * (3 * 2)


def test_train_rows_report_cold_compile_times_and_the_optimizer_share(result):
    rows = result["json"]["train"]
    assert [r["model"] for r in rows] == ["mlp", "transformer"]
    jax_names = {
        "fo adamw",
        "fo adamw via update",
        "fo adamw fused=True",
        "fo adamw fused=False",
        "optax adamw",
    }
    for row in rows:
        assert row["compile_rounds"] == 1  # --quick
        assert jax_names <= set(row["compile_s"])
        assert all(_finite_positive(row["compile_s"][n]) for n in jax_names)
        assert _finite_positive(row["fwd_bwd_compile_s"])
        for n in jax_names:
            assert row["optimizer_compile_s"][n] == pytest.approx(
                row["compile_s"][n] - row["fwd_bwd_compile_s"]
            )
    assert "the median of 1 cold compiles" in result["md"]
    # the accumulation micro-step of the same whole step, timed in the same round robin,
    # kept out of the step's own table and compile rows
    from functorch_optim._bench_train import MICRO

    for row in rows:
        micro = row["micro_step"]
        assert set(micro["times_ms"]) == set(MICRO) and not set(MICRO) & set(row["times_ms"])
        assert all(_finite_positive(t) for t in micro["times_ms"].values())
        assert all(micro["memory_x_params"][n] >= 1 for n in MICRO)  # the accumulator at least
        assert set(micro["paired_vs_add_in"]) == set(MICRO[1:])
        assert not set(MICRO) & set(row["compile_s"])
    assert "| model | forward + backward + add | fo grad_accumulate |" in result["md"]


def test_the_gpu_script_runs_every_part_with_arguments_the_cli_takes(tmp_path):
    # benchmarks/gpu.sh is the GPU run for a session lent a GPU: its commands
    # must parse here, where it cannot run (a shim interpreter parses each bench command
    # line with the CLI's own parser and records it; the backend check runs for real)
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "argv.log"
    shim = tmp_path / "python"
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-" ]; then exec {sys.executable} -; fi\n'
        f'echo "$@" >> {log}\n'
        f"exec {sys.executable} -c 'import sys; from functorch_optim.__main__ import build_parser; "
        'build_parser().parse_args(sys.argv[3:])\' "$@"\n'
    )
    shim.chmod(0o755)
    env = {**os.environ, "PYTHON": str(shim), "ALLOW_CPU": "1", "JAX_PLATFORMS": "cpu"}

    def gpu_sh(out: str) -> subprocess.CompletedProcess:
        script = root / "benchmarks" / "gpu.sh"
        return subprocess.run(
            ["bash", str(script), str(tmp_path / out)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    run = gpu_sh("out")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = log.read_text().splitlines()
    assert len(lines) == 3
    steps, train, merge = lines
    assert "--sections sgd adam adamw adagrad --sizes 1e8x1 1e8x200" in steps
    assert "--sections train" in train and "--compile-rounds 1" in train
    assert "--from-json" in merge and merge.endswith("--no-plot")
    # without a GPU and without ALLOW_CPU it stops before measuring anything
    env.pop("ALLOW_CPU")
    refused = gpu_sh("out2")
    assert refused.returncode != 0 and "not a GPU" in refused.stderr


def test_whole_step_torch_steps_are_timed_to_the_device_s_end(monkeypatch):
    # on a GPU the train section puts torch's models on CUDA, whose steps return before
    # the device is done: every torch contender's call must go through TorchSide.timed
    # (a wait for the device), as on the CPU, where the wait is nothing
    import jax.numpy as jnp
    import numpy as np
    import torch

    from functorch_optim import _bench_train
    from functorch_optim._bench import TorchSide

    waits = []

    class CountingSide(TorchSide):
        def timed(self, fn):
            def run():
                fn()
                waits.append(fn)

            return run

    monkeypatch.setattr(torch, "compile", lambda model: model)  # its compile takes minutes
    rng = np.random.default_rng(0)
    width, batch_size = _bench_train.QUICK["mlp"]
    params = _bench_train.mlp_params(width, rng)
    batch = tuple(jnp.asarray(rng.standard_normal((batch_size, width)), jnp.float32) for _ in range(2))
    contenders = _bench_train._torch_contenders(CountingSide(torch, "cpu"), "mlp", params, 0, batch, print)
    assert [c.name for c in contenders] == [
        "torch eager",
        "torch foreach",
        "torch fused",
        "torch compile fused",
    ]
    assert len(waits) == 2  # the compiled contender's first and second call, timed for its compile
    for contender in contenders:
        contender.run()
    assert len(waits) == 2 + len(contenders)


def test_the_shape_kernels_ablations_each_change_the_rule_and_restore_the_package():
    # benchmarks/shape_kernels.py compiles the rule with a measure of its exactness
    # replaced, by patching the package while it traces: each variant must be its own
    # program (the nested per-shape ``jit`` keeps the first trace unless JAX's caches are
    # cleared, so a stale patch would compile every variant to the rule), and the
    # package must be itself again afterwards
    import runpy
    from pathlib import Path

    from functorch_optim import _adam, _base, _torch_ops

    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "shape_kernels.py"))
    originals = {
        (_torch_ops, "stored"): _torch_ops.stored,
        (_adam, "true_divide"): _adam.true_divide,
        (_adam, "lerp_fma"): _adam.lerp_fma,
        (_base, "_staged_rule"): _base._staged_rule,
    }

    def ops(variant):
        text = script["lowered"]("mlp", variant).as_text()
        assert all(getattr(*key) is value for key, value in originals.items()), variant
        return {op: text.count(f"stablehlo.{op}") for op in ("select", "optimization_barrier", "divide")}

    rule = ops("rule")
    single = {v: ops(v) for v in ("unstored", "plain-divide", "plain-lerp")}
    unguarded = ops("unguarded")
    # stored and the exact divisor are selects; the lerp's branch on its weight too
    for variant, counts in single.items():
        assert counts["select"] < rule["select"], (variant, counts, rule)
        assert unguarded["select"] < counts["select"], (variant, counts, unguarded)
    assert single["plain-divide"]["divide"] == rule["divide"]  # the division stays
    assert ops("barrier")["optimization_barrier"] > rule["optimization_barrier"]
    assert rule == ops("rule")  # the package's rule again, not a variant's trace


def test_the_whole_step_rules_script_prints_a_row_per_model_and_optimizer(tmp_path, monkeypatch, capsys):
    # benchmarks/whole_step_rules.py on the bench's small models: one row per (model,
    # optimizer), each with its three ratios to optax and four compile times
    import runpy
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "whole_step_rules.py"
    out = tmp_path / "rules.md"
    argv = [str(path), "--quick", "--models", "mlp", "--optimizers", "sgd", "adagrad", "--reps", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rounds", "1", "--markdown", str(out)])
    runpy.run_path(str(path), run_name="__main__")
    rows = [line for line in out.read_text().splitlines() if line.startswith("| mlp |")]
    assert [row.split(" | ")[1] for row in rows] == ["sgd", "adagrad"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 10
        assert all(float(c.split()[0]) > 0 for c in cells[2:]), row
    assert rows[0] in capsys.readouterr().out
