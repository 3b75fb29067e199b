"""Multi-device checks, run in subprocesses by tests/test_sharding.py.

jax fixes its device count when it is imported, and the test session imports it (root
conftest.py) with one CPU device; so these checks run as ``python -m`` subprocesses with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax is imported, and
print their measurements as one JSON line. Modes:

* ``devices NAMES...``: 8 simulated devices; for each optimizer name, data-parallel and
  ZeRO-1 training vs the single-device large batch, state memory per device, HLO
  collectives, grad_accumulate and data_parallel_grad accumulation; abstract init.
* ``worker PROCESS_ID PORT``: one of 2 processes of a ``jax.distributed`` run on
  127.0.0.1 (CPU collectives over gloo), a few ZeRO-1 data-parallel steps.

Nothing runs on import (pytest imports this module for doctests).
"""

from __future__ import annotations

import json
import os
import re
import sys

STEPS = 3
BATCH = 64
SHAPES = {"w1": (16, 32), "b1": (32,), "w2": (32, 8), "b2": (8,), "odd": (3, 5)}


def make_problem():
    """Params and one batch per step (float64 numpy), identical in every process."""
    import numpy as np

    rng = np.random.default_rng(0)
    params = {k: 0.3 * rng.standard_normal(s) for k, s in SHAPES.items()}
    batches = [(rng.standard_normal((BATCH, 16)), rng.standard_normal((BATCH, 8))) for _ in range(STEPS)]
    return params, batches


def loss_fn(params, batch):
    import jax.numpy as jnp

    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    out = h @ params["w2"] + params["b2"][None, :]
    return jnp.mean((out - y) ** 2) + 1e-2 * jnp.sum(params["odd"] ** 2) * jnp.mean(x)


def make_tx(name):
    import optax

    import functorch_optim as fo

    factories = {
        "sgd": lambda: fo.sgd(lr=0.05, momentum=0.9, weight_decay=1e-3),
        "optax_adam": lambda: optax.adam(1e-2),
        "adam": lambda: fo.adam(lr=1e-2),
    }
    return factories[name]()


def reference(name):
    """Single-device run on the full batch (the large batch of accumulation)."""
    import jax

    import functorch_optim as fo

    params, batches = make_problem()
    params = jax.tree.map(jax.numpy.asarray, params)
    tx = make_tx(name)
    state = tx.init(params)
    step = jax.jit(lambda p, s, b: fo.step(tx, p, jax.grad(loss_fn)(p, b), s))
    for b in batches:
        params, state = step(params, state, b)
    return params, state


def rel_err(a, b):
    import jax
    import numpy as np

    errs = [0.0]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.size:
            errs.append(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-300)))
    return max(errs)


def per_device_bytes(tree):
    """Max over devices of the bytes of ``tree``'s shards on that device."""
    import jax

    per = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device.id] = per.get(shard.device.id, 0) + shard.data.nbytes
    return max(per.values())


def expected_bytes(tree):
    """Bytes per device if each leaf sharded over 'data' holds exactly 1/8 of itself."""
    import jax

    def sharded(x):
        return any("data" in str(e) for e in x.sharding.spec)

    return sum(x.nbytes // 8 if sharded(x) else x.nbytes for x in jax.tree.leaves(tree))


def spec_str(sharding):
    return str(tuple(sharding.spec))


def shardings_equal(a, b):
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.mesh == y.mesh and tuple(x.spec) == tuple(y.spec) for x, y in zip(la, lb, strict=True)
    )


def collectives(hlo):
    ops = ("all-gather", "all-reduce", "reduce-scatter")
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo)) for op in ops}


def while_bodies_with_all_reduce(hlo):
    """Names of while-loop body computations that contain an all-reduce."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    found = []
    for block in re.split(r"\n\s*\n", hlo):
        head = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s", block)
        if head and head.group(1) in bodies and "all-reduce" in block:
            found.append(head.group(1))
    return found


def check_devices(names):
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import functorch_optim as fo

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rep = NamedSharding(mesh, P())
    dsh = NamedSharding(mesh, P("data"))
    params0, batches = make_problem()
    p_sh = jax.tree.map(lambda _: rep, params0)
    b_sh = (dsh, dsh)
    out = {"devices": jax.device_count()}

    def run(tx, state_sh, micro=1, grad_fn=None):
        params = jax.device_put(params0, p_sh)
        state = jax.jit(tx.init, out_shardings=state_sh)(params)
        mem = per_device_bytes(state)

        def train_step(p, s, b):
            g = grad_fn(p, b)[1] if grad_fn else jax.grad(loss_fn)(p, b)
            return fo.step(tx, p, g, s)

        step = jax.jit(
            train_step,
            in_shardings=(p_sh, state_sh, b_sh),
            out_shardings=(p_sh, state_sh),
            donate_argnums=(0, 1),
            keep_unused=True,  # an input the step never reads is still donated
        )
        n = BATCH // micro
        first = jax.device_put((batches[0][0][:n], batches[0][1][:n]), b_sh)
        compiled = step.lower(params, state, first).compile()
        hlo = compiled.as_text()
        inputs = jax.tree.leaves((params, state))
        for x, y in batches:
            for j in range(micro):
                b = jax.device_put((x[j * n : (j + 1) * n], y[j * n : (j + 1) * n]), b_sh)
                params, state = compiled(params, state, b)
        donated = all(a.is_deleted() for a in inputs)
        same = shardings_equal(jax.tree.map(lambda a: a.sharding, state), state_sh)
        return params, state, mem, collectives(hlo), same and donated, hlo

    for name in names:
        tx = make_tx(name)
        ref_p, ref_s = reference(name)
        res = {}
        params = jax.device_put(params0, p_sh)
        dp_sh = fo.state_shardings(tx, params)
        z_sh = fo.state_shardings(tx, params, zero_axis="data")
        res["zero_specs"] = sorted({spec_str(s) for s in jax.tree.leaves(z_sh)})
        if hasattr(tx.update, "fo_step"):  # this package's init lays the state out itself
            res["init_matches_default"] = shardings_equal(
                jax.tree.map(lambda a: a.sharding, tx.init(params)), dp_sh
            )
        p, s, mem_dp, coll_dp, same_dp, _ = run(tx, dp_sh)
        res["dp"] = {
            "param_err": rel_err(p, ref_p),
            "state_err": rel_err(s, ref_s),
            "state_bytes_per_device": mem_dp,
            "collectives": coll_dp,
            "shardings_unchanged": same_dp,
        }
        p, s, mem_z, coll_z, same_z, _ = run(tx, z_sh)
        res["zero"] = {
            "expected_bytes_per_device": expected_bytes(s),
            "param_err": rel_err(p, ref_p),
            "state_err": rel_err(s, ref_s),
            "state_bytes_per_device": mem_z,
            "collectives": coll_z,
            "shardings_unchanged": same_z,
        }
        res["state_bytes_total"] = int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(ref_s)))
        # torch-style accumulation: 2 calls per step, ZeRO-sharded accumulator
        acc = fo.grad_accumulate(tx, every=2)
        acc_sh = fo.state_shardings(acc, params, zero_axis="data")
        p, s, mem_acc, _, same_acc, _ = run(acc, acc_sh, micro=2)
        res["grad_accumulate"] = {
            "param_err": rel_err(p, ref_p),
            "inner_state_err": rel_err(s.inner_state, ref_s),
            "acc_spec_w1": spec_str(acc_sh.acc_grads["w1"]),
            "state_bytes_per_device": mem_acc,
            "shardings_unchanged": same_acc,
        }
        # one pmean per step: 8 devices x 4 local micro-batches, ZeRO state
        grad_fn = fo.data_parallel_grad(loss_fn, mesh, "data", micro_batches=4)
        p, s, _, coll, same, hlo = run(tx, z_sh, grad_fn=grad_fn)
        res["data_parallel_grad"] = {
            "param_err": rel_err(p, ref_p),
            "state_err": rel_err(s, ref_s),
            "collectives": coll,
            "while_loops": len(re.findall(r"\bwhile\(", hlo)),
            "all_reduce_in_loop_bodies": while_bodies_with_all_reduce(hlo),
            "shardings_unchanged": same,
        }
        out[name] = res
    out["explicit_dp_sgd"] = check_explicit_mesh()
    out["abstract"] = check_abstract(names)
    return out


def check_explicit_mesh():
    """Plain data parallelism on an Explicit mesh axis (default layout, no ZeRO)."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import functorch_optim as fo

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rep, dsh = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params0, batches = make_problem()
    p_sh = jax.tree.map(lambda _: rep, params0)
    tx = make_tx("sgd")
    with jax.set_mesh(mesh):
        params = jax.device_put(params0, p_sh)
        state = tx.init(params)
        s_sh = fo.state_shardings(tx, params)
        step = jax.jit(
            lambda p, s, b: fo.step(tx, p, jax.grad(loss_fn)(p, b), s),
            in_shardings=(p_sh, s_sh, (dsh, dsh)),
            out_shardings=(p_sh, s_sh),
            donate_argnums=(0, 1),
        )
        for b in batches:
            params, state = step(params, state, jax.device_put(b, (dsh, dsh)))
    ref_p, ref_s = reference("sgd")
    return {
        "param_err": rel_err(params, ref_p),
        "state_err": rel_err(state, ref_s),
        "shardings_unchanged": shardings_equal(jax.tree.map(lambda a: a.sharding, state), s_sh),
    }


def check_abstract(names):
    """Init on ShapeDtypeStructs with shardings (a 4 x 2 mesh, params sharded over 'model')."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import functorch_optim as fo

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P(), "odd": P()}
    abstract = {
        k: jax.ShapeDtypeStruct(s, jnp.float64, sharding=NamedSharding(mesh, specs[k]))
        for k, s in SHAPES.items()
    }
    out = {}
    txs = {name: make_tx(name) for name in names}
    txs.update({f"grad_accumulate_{name}": fo.grad_accumulate(make_tx(name), every=4) for name in names})
    for name, tx in txs.items():
        shapes = jax.eval_shape(tx.init, abstract)
        sh = fo.state_shardings(tx, abstract)
        zsh = fo.state_shardings(tx, abstract, zero_axis="data")
        res = {"eval_shape_leaves": len(jax.tree.leaves(shapes))}
        # the default layout: every parameter-shaped buffer carries its parameter's spec
        by_param = {}
        flat = jax.tree_util.tree_flatten_with_path(sh)[0]
        for path, s in flat:
            key = jax.tree_util.keystr(path[-1:])
            if key.strip("[]'") in SHAPES:
                by_param.setdefault(key.strip("[]'"), set()).add(spec_str(s))
        res["default_specs"] = {k: sorted(v) for k, v in sorted(by_param.items())}
        res["zero_specs_w1"] = sorted(
            {spec_str(s) for path, s in jax.tree_util.tree_flatten_with_path(zsh)[0] if "w1" in str(path)}
        )
        if hasattr(tx.update, "fo_step"):
            with jax.transfer_guard("disallow"):
                state = tx.init(abstract)  # built in place on the mesh, from shapes only
            got = jax.tree.map(lambda a: a.sharding, state)
            res["init_from_abstract_matches"] = shardings_equal(got, sh)
            res["init_shapes_match_eval_shape"] = all(
                a.shape == b.shape and a.dtype == b.dtype
                for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(shapes), strict=True)
            )
            res["init_max_abs"] = max(
                float(np.max(np.abs(np.asarray(x, np.float64)))) if np.size(x) else 0.0
                for x in jax.tree.leaves(state)
                if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim
            )
        out[name] = res
    return out


def worker(pid, port):
    """One of 2 processes x 2 CPU devices: 3 ZeRO-1 data-parallel SGD steps."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60
    )
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import functorch_optim as fo

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    rep, dsh = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params0, batches = make_problem()
    p_sh = jax.tree.map(lambda _: rep, params0)
    params = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, rep, lambda i: x[i]), params0)
    tx = make_tx("sgd")
    s_sh = fo.state_shardings(tx, params, zero_axis="data")
    default = tx.init(params)  # this package's init: laid out like the params, on both hosts
    default_ok = fo.state_shardings(tx, params) == jax.tree.map(lambda a: a.sharding, default)
    state = jax.jit(tx.init, out_shardings=s_sh)(params)
    step = jax.jit(
        lambda p, s, b: fo.step(tx, p, jax.grad(loss_fn)(p, b), s),
        in_shardings=(p_sh, s_sh, (dsh, dsh)),
        out_shardings=(p_sh, s_sh),
        donate_argnums=(0, 1),
    )
    half = BATCH // 2
    for x, y in batches:
        # each process loads only its own half of the global batch
        local = (x[pid * half : (pid + 1) * half], y[pid * half : (pid + 1) * half])
        batch = tuple(jax.make_array_from_process_local_data(dsh, v) for v in local)
        params, state = step(params, state, batch)
    buf = state.buffers["momentum_buffer"]["w1"]
    return {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "w1_local_shard_shape": list(buf.addressable_shards[0].data.shape),
        "default_init_matches": bool(default_ok),
        "params": {k: np.asarray(v.addressable_data(0)).tolist() for k, v in params.items()},
    }


def main(argv):
    mode = argv[0]
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    if mode == "devices":
        result = check_devices(argv[1:])
    elif mode == "worker":
        result = worker(int(argv[1]), int(argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if "jax" in sys.modules:
        raise SystemExit("run this as a fresh process: jax must be imported after XLA_FLAGS is set")
    n = 2 if sys.argv[1] == "worker" else 8
    # unoptimised CPU code generation: these programs are tiny, compiling them dominates
    fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    count = f"--xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {count} {fast}"
    main(sys.argv[1:])
