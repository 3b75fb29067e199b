"""averaged_model against torch.optim.swa_utils.AveragedModel (SWA and EMA), float32 and float64."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.optim import swa_utils

import functorch_optim as fo
from tests.helpers import TREE_SHAPES, make_tree

KINDS = {
    "swa-default": (lambda: {}, lambda: {}),
    "swa-avg_fn": (lambda: dict(avg_fn=swa_utils.get_swa_avg_fn()), lambda: dict(avg_fn=fo.get_swa_avg_fn())),
    "swa-multi": (
        lambda: dict(multi_avg_fn=swa_utils.get_swa_multi_avg_fn()),
        lambda: dict(multi_avg_fn=fo.get_swa_multi_avg_fn()),
    ),
    "ema-avg_fn": (
        lambda: dict(avg_fn=swa_utils.get_ema_avg_fn(0.9)),
        lambda: dict(avg_fn=fo.get_ema_avg_fn(0.9)),
    ),
    "ema-multi": (
        lambda: dict(multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.7)),
        lambda: dict(multi_avg_fn=fo.get_ema_multi_avg_fn(0.7)),
    ),
}


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_averaged_model_matches_torch(kind, dtype, mode):
    # bit for bit, jitted or called eagerly (op by op the lerp of the "multi" EMA and
    # SWA rounded its product apart from the add, where torch's lerp is one FMA; under
    # jit XLA contracted one of ``get_ema_avg_fn``'s two products into the sum, where
    # torch rounds each)
    rng = np.random.default_rng(0)
    shapes = TREE_SHAPES["nested"]
    init = make_tree(shapes, rng, dtype)
    snapshots = [make_tree(shapes, rng, dtype) for _ in range(12)]

    leaves, treedef = jax.tree.flatten(init)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.tensor(x)) for x in leaves])
    ref = swa_utils.AveragedModel(model, **KINDS[kind][0]())
    avg = fo.averaged_model(**KINDS[kind][1]())
    state = avg.init(jax.tree.map(jnp.asarray, init))
    update = jax.jit(avg.update) if mode == "jit" else avg.update
    for snap in snapshots:
        with torch.no_grad():
            for p, x in zip(model, treedef.flatten_up_to(snap), strict=True):
                p.copy_(torch.tensor(x))
        ref.update_parameters(model)
        state = update(state, jax.tree.map(jnp.asarray, snap))
        got = treedef.flatten_up_to(state.params)
        for a, b in zip(got, ref.module.parameters(), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b.detach().numpy())
        assert int(state.n_averaged) == int(ref.n_averaged)
    assert got[0].dtype == dtype
    # not a copy of the last snapshot
    assert not np.array_equal(np.asarray(got[0]), treedef.flatten_up_to(snapshots[-1])[0])


def test_first_update_copies_and_init_is_a_copy():
    avg = fo.averaged_model(multi_avg_fn=fo.get_ema_multi_avg_fn(0.5))
    state = avg.init({"w": jnp.array([1.0])})
    assert int(state.n_averaged) == 0
    state = avg.update(state, {"w": jnp.array([5.0])})
    assert state.params["w"].tolist() == [5.0]
    state = avg.update(state, {"w": jnp.array([1.0])})
    assert state.params["w"].tolist() == [3.0] and int(state.n_averaged) == 2


def test_validation_uses_torchs_messages():
    with pytest.raises(ValueError) as ref:
        swa_utils.get_ema_multi_avg_fn(1.5)
    with pytest.raises(ValueError, match=re.escape(str(ref.value))):
        fo.get_ema_multi_avg_fn(1.5)
    with pytest.raises(ValueError, match=re.escape(str(ref.value))):
        fo.get_ema_avg_fn(1.5)
    with pytest.raises(AssertionError) as ref:
        swa_utils.AveragedModel(torch.nn.Linear(1, 1), avg_fn=swa_utils.get_swa_avg_fn(),
                                multi_avg_fn=swa_utils.get_swa_multi_avg_fn())  # fmt: skip
    with pytest.raises(AssertionError, match=re.escape(str(ref.value))):
        fo.averaged_model(avg_fn=fo.get_swa_avg_fn(), multi_avg_fn=fo.get_swa_multi_avg_fn())


def test_state_dict_is_torchs_averaged_model_layout_and_resumes_both_ways(tmp_path):
    """torch AveragedModel 4 updates -> torch.save -> ours 4 -> ours -> torch 4: bit for bit
    the uninterrupted torch average, n_averaged carried as torch's int64 buffer."""
    from functorch_optim.interop.torch import tree_from_module

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    snaps = [[torch.randn_like(p) for p in net.parameters()] for _ in range(12)]

    def set_params(snap):
        with torch.no_grad():
            for p, x in zip(net.parameters(), snap, strict=True):
                p.copy_(x)

    full = swa_utils.AveragedModel(net)
    for snap in snaps:
        set_params(snap)
        full.update_parameters(net)

    ref = swa_utils.AveragedModel(net)
    for snap in snaps[:4]:
        set_params(snap)
        ref.update_parameters(net)
    torch.save(ref.state_dict(), tmp_path / "swa.pt")

    avg = fo.averaged_model()
    like = avg.init(tree_from_module(net))
    state = avg.load_state_dict(torch.load(tmp_path / "swa.pt"), like=like)
    assert int(state.n_averaged) == 4 and state.params["0"]["weight"].dtype == jnp.float64
    for snap in snaps[4:8]:
        set_params(snap)
        state = avg.update(state, tree_from_module(net))

    sd = avg.state_dict(state)
    assert set(sd) == set(ref.state_dict())  # n_averaged and module.<name>
    assert sd["n_averaged"].dtype == torch.int64 and sd["n_averaged"].shape == ()
    torch.save(sd, tmp_path / "ours.pt")
    resumed = swa_utils.AveragedModel(net)
    resumed.load_state_dict(torch.load(tmp_path / "ours.pt"))
    for snap in snaps[8:]:
        set_params(snap)
        resumed.update_parameters(net)
    assert int(resumed.n_averaged) == int(full.n_averaged) == 12
    for a, b in zip(resumed.module.parameters(), full.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # without ``like``: nested dicts by name, the tensors' dtypes
    plain = avg.load_state_dict(sd)
    assert plain.params["2"]["bias"].dtype == jnp.float64 and int(plain.n_averaged) == 8


def test_load_state_dict_names_what_does_not_fit():
    avg = fo.averaged_model()
    like = avg.init({"w": jnp.zeros(2), "b": jnp.zeros(1)})
    good = avg.state_dict(avg.update(like, {"w": jnp.ones(2), "b": jnp.ones(1)}))
    with pytest.raises(ValueError, match=r"missing names \['module.b'\], unexpected names \['module.c'\]"):
        avg.load_state_dict(
            {"n_averaged": good["n_averaged"], "module.w": good["module.w"], "module.c": 1}, like
        )
    with pytest.raises(
        ValueError, match=r"'module.w' has shape \(3,\), but the state's leaf has shape \(2,\)"
    ):
        avg.load_state_dict({**good, "module.w": torch.zeros(3)}, like)
    with pytest.raises(ValueError, match="no 'n_averaged'"):
        avg.load_state_dict({"module.w": good["module.w"]}, like)
    with pytest.raises(ValueError, match="n_averaged must be an integer >= 0"):
        avg.load_state_dict({**good, "n_averaged": torch.tensor(-1)}, like)
