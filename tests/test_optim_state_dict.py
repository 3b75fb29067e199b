"""The facade's torch round trips: formats, parameter identity, strict loading, one source of truth.

Every registered optimizer's ``state_dict()`` is torch's own dict (torch tensors, Python
groups): ``torch.save`` + ``torch.load(path)`` with torch's default ``weights_only=True``
read it, the torch class loads it unconverted, and it survives orbax. Against real torch
throughout (``foreach=False``, float64).
"""

from __future__ import annotations

import copy
import inspect
import os
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
import functorch_optim.optim as fo_optim
from functorch_optim._registry import MUON_SHAPES, OPTIMIZERS
from functorch_optim.interop.torch import (
    flatten_names,
    grads_from_module,
    load_tree_into_module,
    tree_from_module,
    tree_to_state_dict,
)
from functorch_optim.optim import group_by, state_dict_to_numpy, state_dict_to_torch
from tests.helpers import rel_err

SPECS = [pytest.param(s, id=s.torch_name) for s in OPTIMIZERS]

# ---------------------------------------------------------------------------------------
# one harness for every registered optimizer: a facade and a torch optimizer in step
# ---------------------------------------------------------------------------------------

_RNG = np.random.default_rng(7)
_A = (lambda m: m @ m.T + 0.5 * np.eye(64))(_RNG.standard_normal((64, 64)))
_B = _RNG.standard_normal(64)
#: 2-D shapes, which every optimizer takes (Muon only these)
SHAPES_2D = list(MUON_SHAPES.values())
SHAPES_2D_PARAMS = [np.ones(s) for s in SHAPES_2D]


def _objective(flat, xp):
    """LBFGS's closure: a convex quadratic of the flat parameter vector."""
    n = flat.shape[0]
    return 0.5 * flat @ (xp.asarray(_A[:n, :n]) @ flat) - xp.asarray(_B[:n]) @ flat


def _jax_closure(params):
    return _objective(jnp.concatenate([jnp.reshape(p, -1) for p in params]), jnp)


def _shapes(spec):
    return list(spec.shapes.values()) if spec.shapes else [(3, 2), (4,), ()]


def _config(spec):
    # the grid's last entry (the most flags switched on); for LBFGS a fixed-step one (its
    # strong-Wolfe step takes seconds to compile, once per facade)
    cfg = dict(spec.grid[1] if spec.closure else spec.grid[-1])
    if "foreach" in inspect.signature(getattr(torch.optim, spec.torch_name)).parameters:
        cfg["foreach"] = False
    return cfg


def _problem(spec, seed=0, steps=8, shapes=None):
    """Start params and a gradient stream; the last parameter never gets a gradient, the
    second none on the first two steps (no state entry until then, as in torch)."""
    rng = np.random.default_rng(seed)
    shapes = shapes or _shapes(spec)
    params = [rng.standard_normal(s) for s in shapes]
    stream = []
    for t in range(steps):
        grads = [rng.standard_normal(s) for s in shapes]
        grads[1] = None if t < 2 else grads[1]
        grads[-1] = None
        stream.append(grads)
    return params, stream


def _ours(spec, params, **overrides):
    return getattr(fo_optim, spec.torch_name)(params, **{**_config(spec), **overrides})


def _theirs(spec, params, **overrides):
    ts = [torch.tensor(np.array(p), requires_grad=True) for p in params]
    return ts, getattr(torch.optim, spec.torch_name)(ts, **{**_config(spec), **overrides})


def _step_ours(spec, opt, stream):
    for grads in stream:
        if spec.closure:
            opt.step(_jax_closure)
        else:
            opt.grad = grads
            opt.step()


def _step_theirs(spec, ts, t_opt, stream):
    def closure():
        t_opt.zero_grad()
        loss = _objective(torch.cat([t.reshape(-1) for t in ts]), torch)
        loss.backward()
        return loss

    for grads in stream:
        if spec.closure:
            t_opt.step(closure)
            continue
        for t, g in zip(ts, grads, strict=True):
            t.grad = None if g is None else torch.tensor(g)
            if g is not None and spec.sparse_grad:
                t.grad = t.grad.to_sparse()
        t_opt.step()


def _host(ts):
    return [t.detach().numpy() for t in ts]


def _arrays(value):
    """Every array-like leaf of a state dict's state (inside lists too)."""
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, list | tuple):
        return [a for v in value for a in _arrays(v)]
    return [value] if hasattr(value, "shape") else []


def _assert_same(a, b):
    """Two facades hold the same parameters and torch-layout state, bit for bit."""
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _assert_same_dict(a.state_dict(), b.state_dict())


def _assert_same_dict(sa, sb):
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"])
    for k, entry in sb["state"].items():
        assert sorted(sa["state"][k]) == sorted(entry)
        for x, y in zip(_arrays(sa["state"][k]), _arrays(entry), strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), k


# ---------------------------------------------------------------------------------------
# formats: torch tensors, torch.load's safe default, no conversion, orbax
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_state_dict_is_torchs_own_and_torch_load_reads_it_safely(spec, tmp_path):
    params, stream = _problem(spec)
    opt = _ours(spec, params)
    _step_ours(spec, opt, stream[:4])
    sd = opt.state_dict()
    arrays = _arrays(sd["state"])
    assert arrays and all(isinstance(a, torch.Tensor) for a in arrays)
    plain = (bool, int, float, str, type(None), tuple, list)
    assert all(type(v) in plain for g in sd["param_groups"] for v in g.values())
    path = os.path.join(tmp_path, "optimizer.pt")
    torch.save(sd, path)
    loaded = torch.load(path)  # torch's default weights_only=True

    # torch resumes from it unconverted and continues as our run does
    ts, t_opt = _theirs(spec, [np.asarray(p) for p in opt.params], lr=0.5)
    t_opt.load_state_dict(loaded)
    assert t_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    resumed = _ours(spec, opt.params, lr=0.5)
    resumed.load_state_dict(loaded)
    _assert_same(resumed, opt)
    _step_theirs(spec, ts, t_opt, stream[4:])
    _step_ours(spec, opt, stream[4:])
    _step_ours(spec, resumed, stream[4:])
    assert rel_err(_host(ts), opt.params) <= 1e-10
    _assert_same(resumed, opt)
    # and back: torch's dict after its steps is ours after ours, entry by entry (LBFGS has
    # converged: its near-zero vectors and iteration counts carry no precision left)
    back = _ours(spec, _host(ts), lr=0.5)
    back.load_state_dict(t_opt.state_dict())
    ours, theirs = opt.state_dict(), back.state_dict()
    assert theirs["param_groups"] == ours["param_groups"]
    assert sorted(theirs["state"]) == sorted(ours["state"])
    for k, entry in ours["state"].items():
        assert sorted(theirs["state"][k]) == sorted(entry)
        for name, value in entry.items():
            mine = theirs["state"][k][name]
            if spec.closure:
                continue
            if not isinstance(value, torch.Tensor):
                assert mine == value, (k, name)
            else:
                # torch's load casts its float32 scalars (mu_product, eta) to the parameter's
                # dtype and continues in float64: they differ from ours in float32 rounding
                tol = 1e-10 if value.dtype == torch.float64 else 1e-6
                assert mine.dtype == value.dtype and rel_err(mine, value) <= tol, (k, name)


@pytest.mark.parametrize("spec", SPECS)
def test_torch_layout_dict_survives_orbax_bit_exactly(spec, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params, stream = _problem(spec)
    opt = _ours(spec, params)
    _step_ours(spec, opt, stream[:4])
    checkpointer = ocp.PyTreeCheckpointer()  # stores param_names' strings, unlike StandardCheckpointer
    path = os.path.join(tmp_path, "optimizer")
    checkpointer.save(path, state_dict_to_numpy(opt.state_dict()))
    restored = checkpointer.restore(path)
    assert all(isinstance(k, str) for k in restored["state"])  # what orbax does to the ids

    back = _ours(spec, opt.params, lr=0.5)
    back.load_state_dict(restored)
    _assert_same(back, opt)
    assert [{k: v for k, v in g.items() if k != "params"} for g in back.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ]
    # and torch takes it after state_dict_to_torch (NumPy arrays -> tensors, ids -> ints)
    ts, t_opt = _theirs(spec, [np.asarray(p) for p in opt.params])
    t_opt.load_state_dict(state_dict_to_torch(restored))
    _step_theirs(spec, ts, t_opt, stream[4:])
    _step_ours(spec, back, stream[4:])
    assert rel_err(_host(ts), back.params) <= 1e-10


def test_state_dict_to_torch_still_converts_numpy_dicts():
    params, stream = _problem(OPTIMIZERS[1])  # Adam
    spec = OPTIMIZERS[1]
    opt = _ours(spec, params)
    _step_ours(spec, opt, stream[:3])
    sd = opt.state_dict()
    as_numpy = {
        "state": {k: {n: v.numpy() for n, v in e.items()} for k, e in sd["state"].items()},
        "param_groups": [{**g, "lr": np.float64(g["lr"])} for g in sd["param_groups"]],
    }
    converted = state_dict_to_torch(as_numpy)
    assert type(converted["param_groups"][0]["lr"]) is float
    for k, e in converted["state"].items():
        for n, v in e.items():
            assert isinstance(v, torch.Tensor) and v.dtype == sd["state"][k][n].dtype
            assert torch.equal(v, sd["state"][k][n])
    _, t_opt = _theirs(spec, [np.asarray(p) for p in opt.params])
    t_opt.load_state_dict(converted)
    assert torch.equal(t_opt.state_dict()["state"][1]["exp_avg_sq"], sd["state"][1]["exp_avg_sq"])
    assert state_dict_to_torch(sd)["state"][0]["exp_avg"] is not sd["state"][0]["exp_avg"]  # a copy


def test_bfloat16_state_comes_out_as_bfloat16_tensors():
    opt = fo_optim.Adam([jnp.ones(3, jnp.bfloat16)], lr=0.1)
    opt.grad = [jnp.full(3, 0.5, jnp.bfloat16)]
    opt.step()
    sd = opt.state_dict()
    t = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    t_opt = torch.optim.Adam([t], lr=0.1, foreach=False)
    t.grad = torch.full((3,), 0.5, dtype=torch.bfloat16)
    t_opt.step()
    for name, value in t_opt.state_dict()["state"][0].items():
        assert sd["state"][0][name].dtype == value.dtype and torch.equal(sd["state"][0][name], value)
    assert state_dict_to_numpy(sd)["state"][0]["exp_avg"].dtype == jnp.bfloat16
    again = fo_optim.Adam(opt.params, lr=0.1)
    again.load_state_dict(sd)
    _assert_same(again, opt)


# ---------------------------------------------------------------------------------------
# parameter identity: named_parameters() order and torch's param_names
# ---------------------------------------------------------------------------------------


def test_tree_from_module_flattens_in_named_parameters_order():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(12)]).double()  # "10" < "2"
    names = [n for n, _ in model.named_parameters()]
    tree = tree_from_module(model)
    assert list(flatten_names(tree)) == names
    for leaf, p in zip(jax.tree.leaves(tree), model.parameters(), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), p.detach().numpy())
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    grads = grads_from_module(model)
    assert jax.tree.structure(grads) == jax.tree.structure(tree)
    assert list(tree_to_state_dict(tree)) == names
    # a facade over it numbers and names the parameters as torch does
    opt = fo_optim.SGD(tree, lr=0.1, momentum=0.9)
    opt.grad = grads
    opt.step()
    t_opt = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    t_opt.step()
    ours, theirs = opt.state_dict(), t_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for k, entry in theirs["state"].items():
        assert torch.equal(ours["state"][k]["momentum_buffer"], entry["momentum_buffer"]), names[k]
    other = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(12)]).double()
    load_tree_into_module(other, opt.params)
    for a, b in zip(other.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


class Attention(torch.nn.Module):
    """Bias-free q/k/v/o projections of one size: a permutation keeps every shape."""

    def __init__(self, d=4):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).T / 2.0, dim=-1)
        return self.o(a @ self.v(x))


def attention_loss(params, x, y):
    def lin(name, h):
        return h @ params[name]["weight"].T

    a = jax.nn.softmax(lin("q", x) @ lin("k", x).T / 2.0, axis=-1)
    return jnp.mean((lin("o", a @ lin("v", x)) - y) ** 2)


def _attention(seed=0):
    torch.manual_seed(seed)
    return Attention().double()


def _batches(n=9):
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((5, 4)), rng.standard_normal((5, 4))) for _ in range(n)]


def _torch_train(model, t_opt, batches):
    for x, y in batches:
        t_opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.tensor(x)), torch.tensor(y)).backward()
        t_opt.step()


def test_qkvo_adam_torch_to_facade_to_torch_equals_one_torch_run():
    batches = _batches()
    ref = _attention()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05, foreach=False)
    _torch_train(ref, ref_opt, batches[:6])
    at_six = [p.detach().numpy().copy() for p in ref.parameters()]
    _torch_train(ref, ref_opt, batches[6:])

    # torch, 3 steps (built from named_parameters(): its dict carries param_names)
    model = _attention()
    t_opt = torch.optim.Adam(model.named_parameters(), lr=0.05, foreach=False)
    _torch_train(model, t_opt, batches[:3])
    # facade, 3 steps, from torch's dict
    opt = fo_optim.Adam(tree_from_module(model), lr=0.5)
    assert opt.param_groups[0]["param_names"] == ["q.weight", "k.weight", "v.weight", "o.weight"]
    opt.load_state_dict(t_opt.state_dict())
    assert opt.param_groups[0]["lr"] == 0.05
    for x, y in batches[3:6]:
        opt.zero_grad()
        opt.backward(attention_loss, jnp.asarray(x), jnp.asarray(y))
        opt.step()
    assert rel_err(jax.tree.leaves(opt.params), at_six) <= 1e-12
    # torch again, 3 steps, from the facade's dict, built from model.parameters() (no names)
    back = _attention(seed=1)
    load_tree_into_module(back, opt.params)
    back_opt = torch.optim.Adam(back.parameters(), lr=0.5, foreach=False)
    back_opt.load_state_dict(opt.state_dict())
    _torch_train(back, back_opt, batches[6:])
    assert rel_err(_host(back.parameters()), _host(ref.parameters())) <= 1e-12


def test_a_permuted_load_is_refused_naming_the_first_differing_name():
    model = _attention()
    t_opt = torch.optim.Adam(model.named_parameters(), lr=0.05, foreach=False)
    _torch_train(model, t_opt, _batches(2))
    sorted_tree = {name: dict(layer) for name, layer in tree_from_module(model).items()}  # plain dicts
    opt = fo_optim.Adam(sorted_tree, lr=0.05)
    assert opt.param_groups[0]["param_names"] == ["k.weight", "o.weight", "q.weight", "v.weight"]
    before = opt.state_dict()
    message = (
        r"parameter 0 of group 0 is 'q\.weight', but this optimizer's parameter at that position "
        r"is 'k\.weight' \(the same names in another order\)"
    )
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(t_opt.state_dict())
    assert opt.state_dict() == before  # nothing changed
    # the other way: the facade's sorted dict into a facade in torch's order
    opt.grad = jax.tree.map(jnp.ones_like, opt.params)
    opt.step()
    ordered = fo_optim.Adam(tree_from_module(model), lr=0.05)
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 is 'k\.weight', but .* is 'q\.weight'"):
        ordered.load_state_dict(opt.state_dict())
    # without names on one side torch's positional rule applies (nothing to compare)
    unnamed = opt.state_dict()
    del unnamed["param_groups"][0]["param_names"]
    ordered.load_state_dict(unnamed)
    assert ordered.param_groups[0]["param_names"] == ["q.weight", "k.weight", "v.weight", "o.weight"]


def test_param_names_follow_torchs_rules():
    w, b = jnp.ones((2, 2)), jnp.zeros(2)
    assert "param_names" not in fo_optim.SGD([w, b], lr=0.1).param_groups[0]  # model.parameters()
    assert fo_optim.SGD({"w": w, "b": b}, lr=0.1).param_groups[0]["param_names"] == ["b", "w"]
    grouped = fo_optim.SGD(group_by({"enc": {"w": w, "b": b}}, {"where": "b$", "lr": 0.5}), lr=0.1)
    assert [g["param_names"] for g in grouped.param_groups] == [["enc.b"], ["enc.w"]]
    mixed = fo_optim.SGD([{"params": {"w": w}}, {"params": [b]}], lr=0.1)  # names for all groups or none
    assert all("param_names" not in g for g in mixed.param_groups)
    given = fo_optim.SGD([{"params": [w, b], "param_names": ["fc.weight", "fc.bias"]}], lr=0.1)
    assert given.state_dict()["param_groups"][0]["param_names"] == ["fc.weight", "fc.bias"]
    with pytest.raises(ValueError, match="param_names of parameter group 0 has 1 names for 2 parameters"):
        fo_optim.SGD([{"params": [w, b], "param_names": ["fc.weight"]}], lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"all optimizer param groups should be with/without names\. cannot add param group "
        "without names to the optimizer",
    ):
        fo_optim.SGD([{"params": [w], "param_names": ["w"]}, {"params": [b]}], lr=0.1)
    with pytest.raises(ValueError, match="cannot add param group without names to the optimizer"):
        given.add_param_group({"params": [jnp.ones(3)]})
    # derived names are dropped when a group without names joins; kept when it has them
    opt = fo_optim.SGD([{"params": {"w": w}}], lr=0.1)
    opt.add_param_group({"params": {"b": b}})
    assert [g["param_names"] for g in opt.param_groups] == [["w"], ["b"]]
    opt.add_param_group({"params": [jnp.ones(3)]})
    assert all("param_names" not in g for g in opt.param_groups)
    # a loaded dict's names replace none (torch's rule); no names in the dict keep ours
    unnamed = fo_optim.SGD([w, b], lr=0.1)
    unnamed.load_state_dict(given.state_dict())
    assert unnamed.param_groups[0]["param_names"] == ["fc.weight", "fc.bias"]
    named = fo_optim.SGD({"w": w, "b": b}, lr=0.1)
    named.load_state_dict(fo_optim.SGD([w, b], lr=0.2).state_dict())
    assert named.param_groups[0]["param_names"] == ["b", "w"] and named.param_groups[0]["lr"] == 0.2


# ---------------------------------------------------------------------------------------
# strict loading: every refusal names the parameter and the key, and changes nothing
# ---------------------------------------------------------------------------------------


def _buffer(sd, dtype=None):
    """The first array entry of parameter 0 other than the counters (of ``dtype`` if given)."""
    names = [
        n
        for n, v in sd["state"][0].items()
        if isinstance(v, torch.Tensor) and v.ndim > 0 and (dtype is None or v.dtype == dtype)
    ]
    return names[0]


def _counter(spec):
    return "n_iter" if spec.closure else "step"


def _foreign_key(spec):
    """A hyperparameter some other registered optimizer takes and this one does not."""
    own = set(inspect.signature(getattr(fo_optim, spec.torch_name)).parameters)
    others = [k for o in OPTIMIZERS for k in inspect.signature(o.factory).parameters]
    return next(k for k in others if k not in own)


def _edit_missing_counter(sd, spec):
    del sd["state"][0][_counter(spec)]
    return rf"parameter 0 has no '{_counter(spec)}'"


def _edit_negative_counter(sd, spec):
    sd["state"][0][_counter(spec)] = torch.tensor(-5.0) if spec.torch_name != "SparseAdam" else -5
    return rf"'{_counter(spec)}' of parameter 0 is .*; it must be a whole number >= 0"


def _edit_fractional_counter(sd, spec):
    sd["state"][0][_counter(spec)] = torch.tensor(2.5)
    return rf"'{_counter(spec)}' of parameter 0 is .*; it must be a whole number >= 0"


def _edit_missing_buffer(sd, spec):
    name = _buffer(sd)
    del sd["state"][0][name]
    return rf"parameter 0 has no '{name}'"


def _edit_extra_buffer(sd, spec):
    sd["state"][0]["bogus"] = torch.zeros(1, dtype=torch.float64)
    return rf"parameter 0 has state 'bogus', which {spec.torch_name} (with these settings )?does not keep"


def _edit_shape(sd, spec):
    name = _buffer(sd)
    sd["state"][0][name] = torch.zeros((*sd["state"][0][name].shape, 2), dtype=torch.float64)
    return rf"{name} of parameter 0 has (shape|\d+ entries)"


def _edit_dtype(sd, spec):
    name = _buffer(sd, torch.float64)
    sd["state"][0][name] = sd["state"][0][name].float()
    return rf"{name} of parameter 0 has dtype float32, but {spec.torch_name} keeps it in float64"


def _edit_repeated_id(sd, spec):
    sd["param_groups"][0]["params"][1] = sd["param_groups"][0]["params"][0]
    return "lists parameter id 0 more than once"


def _edit_unknown_id(sd, spec):
    sd["state"][99] = sd["state"][0]
    return "state for parameter id 99"


def _edit_more_groups(sd, spec):
    sd["param_groups"].append({**sd["param_groups"][0], "params": [97, 98, 99]})
    return "^loaded state dict has a different number of parameter groups$"


def _edit_group_size(sd, spec):
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    sd["param_groups"][0].pop("param_names", None)
    return "^loaded state dict contains a parameter group that doesn't match the size of optimizer's group$"


def _edit_missing_hyperparameter(sd, spec):
    del sd["param_groups"][0]["lr"]
    return "parameter group 0 lacks 'lr'"


def _edit_foreign_hyperparameter(sd, spec):
    key = _foreign_key(spec)
    sd["param_groups"][0][key] = 0.5
    return rf"parameter group 0 has '{key}', a hyperparameter of .* that {spec.torch_name} does not take"


REFUSALS = {
    "missing-step": _edit_missing_counter,
    "negative-step": _edit_negative_counter,
    "fractional-step": _edit_fractional_counter,
    "missing-buffer": _edit_missing_buffer,
    "extra-buffer": _edit_extra_buffer,
    "wrong-shape": _edit_shape,
    "wrong-dtype": _edit_dtype,
    "repeated-id": _edit_repeated_id,
    "unknown-id": _edit_unknown_id,
    "more-groups": _edit_more_groups,
    "group-size": _edit_group_size,
    "missing-hyperparameter": _edit_missing_hyperparameter,
    "foreign-hyperparameter": _edit_foreign_hyperparameter,
}
#: torch raises these itself, with the same text
TORCH_RAISES = ("more-groups", "group-size")
#: SGD and Muon keep no step in torch's layout; LBFGS's global state is its own (n_iter)
NO_STEP = {"SGD", "Muon"}
#: LBFGS: one global entry, so no per-parameter id cases; its "missing-hyperparameter" is
#: torch's (a group lacking lr is filled from the current one, as before)
LBFGS_SKIP = ("repeated-id", "missing-hyperparameter")


def refusal_cases():
    for spec in OPTIMIZERS:
        for case in REFUSALS:
            if case.endswith("-step") and spec.torch_name in NO_STEP:
                continue
            if spec.closure and case in LBFGS_SKIP:
                continue
            yield pytest.param(spec, case, id=f"{spec.torch_name}-{case}")


@pytest.fixture(scope="module")
def stepped():
    """Per optimizer, its facade after 4 steps (the grid's last configuration)."""
    out = {}
    for spec in OPTIMIZERS:
        params, stream = _problem(spec)
        opt = _ours(spec, params)
        _step_ours(spec, opt, stream[:4])
        out[spec.torch_name] = opt
    return out


@pytest.mark.parametrize(("spec", "case"), list(refusal_cases()))
def test_load_refuses_bad_dicts_before_changing_anything(spec, case, stepped):
    sd = copy.deepcopy(stepped[spec.torch_name].state_dict())
    message = REFUSALS[case](sd, spec)
    params, _ = _problem(spec, seed=1)
    opt = _ours(spec, params, lr=0.25)
    before = opt.state_dict()
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    _assert_same_dict(opt.state_dict(), before)
    assert opt.param_groups[0]["lr"] == 0.25
    if case in TORCH_RAISES:
        _, t_opt = _theirs(spec, params)
        with pytest.raises(ValueError, match=message):
            t_opt.load_state_dict(sd)


#: Dicts of another class that cannot be told from this class's own, and load, (source,
#: target, stepped): AdamW's dict into Adam is Adam with decoupled_weight_decay=True,
#: which is AdamW in torch 2.13, and so is Adam's with it into AdamW (the registry's
#: stepped configurations have it); RAdam's (and a never-stepped Adamax's) hold only keys
#: and buffers Adam's have, the flags Adam's lack (amsgrad, fused) missing, as in a dict
#: of an older torch.
INDISTINGUISHABLE = {
    ("AdamW", "Adam", True),
    ("AdamW", "Adam", False),
    ("Adam", "AdamW", True),
    ("RAdam", "Adam", True),
    ("RAdam", "Adam", False),
    ("RAdam", "AdamW", True),
    ("Adamax", "Adam", False),
    ("Adamax", "AdamW", False),
    ("Adamax", "RAdam", False),
}


def test_another_optimizers_dict_is_refused(stepped):
    """Every registered class's dict, stepped and never stepped, into every other class
    (built on the source's parameters; Muon takes only 2-D ones, so only Muon's own)."""
    loaded = set()
    for source in OPTIMIZERS:
        params = stepped[source.torch_name].params
        dicts = {
            True: stepped[source.torch_name].state_dict(),
            False: getattr(fo_optim, source.torch_name)(params).state_dict(),  # its groups only
        }
        for target in OPTIMIZERS:
            if target is source or (target.shapes and not source.shapes):
                continue
            for is_stepped, sd in dicts.items():
                opt = getattr(fo_optim, target.torch_name)(params)
                try:
                    opt.load_state_dict(sd)
                except ValueError as e:
                    assert str(e).startswith("loaded state dict"), (source.name, target.name, str(e))
                    continue
                loaded.add((source.torch_name, target.torch_name, is_stepped))
    assert loaded == INDISTINGUISHABLE
    # never-stepped dicts of every class into Muon (their groups only)
    for source in OPTIMIZERS:
        if source.shapes is None:
            sd = getattr(fo_optim, source.torch_name)(SHAPES_2D_PARAMS).state_dict()
            with pytest.raises(ValueError, match="loaded state dict: parameter group 0"):
                fo_optim.Muon(SHAPES_2D_PARAMS).load_state_dict(sd)
    params = stepped["Adam"].params
    dicts = {name: getattr(fo_optim, name)(params).state_dict() for name in ("SGD", "Adam")}
    # the cases of the report: Adam's dict into NAdam, a never-stepped SGD's into Adam
    with pytest.raises(ValueError, match="parameter group 0 has 'amsgrad', a hyperparameter of Adam, AdamW"):
        fo_optim.NAdam(params).load_state_dict(stepped["Adam"].state_dict())
    with pytest.raises(ValueError, match="parameter group 0 has 'momentum', a hyperparameter of SGD"):
        fo_optim.Adam(params).load_state_dict(dicts["SGD"])


def test_sgd_momentum_buffer_none_loads_as_not_stepped_like_torch():
    # torch before 2.1 wrote momentum_buffer=None for momentum=0; loaded into momentum>0,
    # the first step seeds the buffer with the gradient
    w = np.array([1.0, -2.0])
    sd = {
        "state": {0: {"momentum_buffer": None}},
        "param_groups": [{**fo_optim.SGD([w]).state_dict()["param_groups"][0]}],
    }
    sd["param_groups"][0].update(lr=0.1, momentum=0.9)
    opt = fo_optim.SGD([w], lr=0.5, momentum=0.5)
    opt.load_state_dict(sd)
    ts, t_opt = _theirs(OPTIMIZERS[0], [w], lr=0.5, momentum=0.5)
    t_opt.load_state_dict(sd)
    for g in (np.array([0.5, 0.25]), np.array([-1.0, 2.0])):
        opt.grad = [g]
        opt.step()
        ts[0].grad = torch.tensor(g)
        t_opt.step()
    assert rel_err(opt.params, _host(ts)) <= 1e-15
    with pytest.raises(ValueError, match="parameter 0 has no 'momentum_buffer'"):
        opt.load_state_dict({**sd, "state": {0: {}}})


# ---------------------------------------------------------------------------------------
# one source of truth: pending param_groups edits are in every checkpoint
# ---------------------------------------------------------------------------------------


def test_state_sees_pending_param_group_edits():
    opt = fo_optim.SGD({"w": jnp.ones(2)}, lr=0.1, momentum=0.9)
    opt.param_groups[0]["lr"] = 0.025  # as a scheduler's step() writes it
    assert float(fo.get_hparams(opt.state)["lr"]) == 0.025
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.025
    assert float(fo.get_hparams(pickle.loads(pickle.dumps(opt)).state)["lr"]) == 0.025
    old = opt.state
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0"):
        opt.state  # noqa: B018
    # assigning restores the state whole: its lr replaces a pending one
    opt.state = old
    assert opt.param_groups[0]["lr"] == 0.025
    lbfgs = fo_optim.LBFGS({"x": jnp.zeros(2)})
    lbfgs.param_groups[0]["lr"] = 0.5
    assert float(fo.get_hparams(lbfgs.state)["lr"]) == 0.5


def test_checkpoint_after_scheduler_step_resumes_bit_identically_in_a_fresh_process(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    from tests import _resume_checks as rc

    opt, scheduler = rc.build()
    rc.train(opt, scheduler, range(rc.SPLIT))
    pending = opt.param_groups[0]["lr"]
    assert pending != float(fo.get_hparams(opt._states[0])["lr"])  # scheduler.step() is pending
    rc.checkpoint(opt, scheduler, str(tmp_path))
    rc.train(opt, scheduler, range(rc.SPLIT, rc.STEPS))
    expected = rc.summary(opt, scheduler)

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests._resume_checks", str(tmp_path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "RESUMED" in proc.stdout, proc.stderr[-3000:]
    for path in rc.PATHS:
        got = np.load(os.path.join(tmp_path, f"{path}.npz"))
        assert sorted(got.files) == sorted(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, (path, key)
            np.testing.assert_array_equal(got[key], value, err_msg=f"{path}: {key}")
