"""The learning-rate schedule and the rate the metrics report.

* Warmup starts at a non-zero rate: update k <= W uses peak * k / W, so the first update moves the parameters.
* The logged `learning_rate` is the rate the update applied, read from the optimizer's own update count: after
  an update skipped for non-finite gradients (which `optax.apply_if_finite` does not count), the next batches
  use the rates the skipped one would have used, and the skipped step itself reports 0.

Shape letters: G global batch, T sequence length.
"""

import dataclasses
import math
import os

import jax
import numpy as np
import pytest
from step_helpers import FP32, compile_fast, device_batch, host_batch, planner, to_host

from jaxpar.config.schema import OptimizerConfig
from jaxpar.training.optimizer import learning_rate_schedule
from jaxpar.training.state import init_state
from jaxpar.training.step import make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

T, G = 8, 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
SEED = 3


def _rate(schedule, update: int) -> float:
    """The rate of the `update`-th update (1-based): the schedule at the count of updates before it."""
    return float(schedule(update - 1))


@pytest.mark.parametrize("decay", ["linear", "cosine", "constant"])
def test_schedule_values_at_the_documented_updates(decay):
    peak, ratio, warmup, steps = 3e-3, 0.1, 20, 200
    schedule = learning_rate_schedule(
        OptimizerConfig(learning_rate=peak, warmup_steps=warmup, decay=decay, min_lr_ratio=ratio), steps
    )
    end, d = peak * ratio, steps - warmup
    last = {
        "linear": peak + (end - peak) * (d - 1) / d,
        "cosine": end + (peak - end) * (1 + math.cos(math.pi * (d - 1) / d)) / 2,
        "constant": peak,
    }[decay]
    got = [_rate(schedule, k) for k in (1, 2, warmup, warmup + 1, steps)]
    np.testing.assert_allclose(got, [peak / warmup, 2 * peak / warmup, peak, peak, last], rtol=1e-6)
    assert float(schedule(steps)) == pytest.approx(end if decay != "constant" else peak, rel=1e-6)
    assert min(_rate(schedule, k) for k in range(1, steps + 1)) > 0  # no update runs at rate 0


_plan = planner(*FP32, "mesh.data=2", "mesh.fsdp=1", f"train.global_batch_size={G}")


def _batches(plan, n):
    return [device_batch(plan, host_batch([T] * G, T, seed=SEED + i)) for i in range(n)]


def test_first_update_moves_every_parameter():
    """The default warmup (20 updates): the first update runs at 3e-3 / 20, not 0."""
    plan = _plan(["train.steps=200"], 2)
    assert plan.cfg.optimizer.warmup_steps == 20
    state = init_state(plan, SEED)
    (batch,) = _batches(plan, 1)
    step = compile_fast(make_train_step(plan), state, batch)
    before = to_host(state["params"])
    state, metrics = step(state, batch)
    for path, old, new in zip(
        jax.tree_util.tree_flatten_with_path(before)[0],
        jax.tree.leaves(before),
        jax.tree.leaves(to_host(state["params"])),
    ):
        assert not np.array_equal(old, new), f"{jax.tree_util.keystr(path[0])} did not move in the first update"
    assert float(metrics["learning_rate"]) == pytest.approx(plan.cfg.optimizer.learning_rate / 20, rel=1e-6)


def test_logged_rate_is_the_applied_rate_after_a_skipped_update():
    """Linear decay 1e-2 -> 0 over 4 steps, no warmup, a non-finite step 2 (a NaN loss mask makes every
    gradient NaN): the four steps report 1e-2, 0 (skipped), 7.5e-3, 5e-3, the rates a run that never saw the
    bad batch applies to the same three good batches, and both runs end with the same parameters."""
    plan = _plan(
        [
            "train.steps=4",
            "optimizer.warmup_steps=0",
            "optimizer.decay=linear",
            "optimizer.learning_rate=1e-2",
            "optimizer.min_lr_ratio=0",
        ],
        2,
    )

    good = _batches(plan, 3)
    bad = device_batch(plan, dict(host_batch([T] * G, T, seed=SEED), loss_mask=np.full((G, T), np.nan, np.float32)))
    step = compile_fast(make_train_step(plan), init_state(plan, SEED), good[0])

    def run(batches):
        state, rates, skipped = init_state(plan, SEED), [], []
        for batch in batches:
            state, metrics = step(state, batch)
            rates.append(float(metrics["learning_rate"]))
            skipped.append(int(metrics["skipped_steps"]))
        return state, rates, skipped

    state, rates, skipped = run([good[0], bad, good[1], good[2]])
    assert skipped == [0, 1, 1, 1]
    np.testing.assert_allclose(rates, [1e-2, 0.0, 7.5e-3, 5e-3], rtol=1e-6)
    clean, clean_rates, _ = run(good)
    np.testing.assert_allclose(clean_rates, [1e-2, 7.5e-3, 5e-3], rtol=1e-6)
    assert int(state["step"]) == 4 and int(clean["step"]) == 3
    for a, b in zip(jax.tree.leaves(to_host(state["params"])), jax.tree.leaves(to_host(clean["params"]))):
        np.testing.assert_array_equal(a, b)  # the skipped update changed nothing: the same computation follows


def _rank_rule(logical: dict) -> dict:
    """The weight-decay mask before optimizer.weight_decay_exclude: decay leaves of two or more non-layer dims."""
    return jax.tree.map(
        lambda axes: len([a for a in axes if a != "layers"]) >= 2, logical, is_leaf=lambda x: isinstance(x, tuple)
    )


def test_weight_decay_exclude_default_is_the_rank_rule_and_patterns_are_checked_against_the_model(caplog):
    """The default patterns give the mask the fixed rule gave (every parameter of two or more non-layer dimensions
    decayed: the losses stay as they were), for the dense and the MoE model; `embed.*` spares the embedding; a
    pattern matching no parameter is a ConfigError naming the key, the pattern and the names. Abstract model
    only: nothing is compiled."""
    from jaxpar.config import ConfigError, load_config
    from jaxpar.model import logical_axes
    from jaxpar.training.optimizer import check_weight_decay_exclude, parameter_names, weight_decay_mask

    for path in (os.path.join(ROOT, "configs", "tiny_moe.yaml"), TINY_YAML):
        cfg = load_config(path, validate=False)
        logical = logical_axes(cfg.model)
        assert weight_decay_mask(logical, cfg.optimizer.weight_decay_exclude) == _rank_rule(logical)
        check_weight_decay_exclude(cfg.optimizer, logical)
    assert not [r for r in caplog.records if "weight decay applies" in r.getMessage()]

    # the override as a user writes it (quoted: YAML reads a bare *... as an alias); the dense model's names
    cfg = load_config(TINY_YAML, ["optimizer.weight_decay_exclude=['*.scale','embed.*']"], validate=False)
    logical = logical_axes(cfg.model)
    names, mask = parameter_names(logical), weight_decay_mask(logical, cfg.optimizer.weight_decay_exclude)
    assert (
        names["embed"]["table"] == "embed.table" and names["blocks"]["attn_norm"]["scale"] == "blocks.attn_norm.scale"
    )
    assert (
        mask["embed"]["table"] is False and mask["lm_head"]["kernel"] is True and mask["final_norm"]["scale"] is False
    )

    typo = dataclasses.replace(cfg.optimizer, weight_decay_exclude=("*.scale", "embedding.*"))
    with pytest.raises(
        ConfigError,
        match=r"optimizer.weight_decay_exclude: the pattern 'embedding.\*' matches no "
        r"parameter of this model; its parameters are .*embed.table",
    ):
        check_weight_decay_exclude(typo, logical)

    check_weight_decay_exclude(dataclasses.replace(cfg.optimizer, weight_decay_exclude=("embed.*",)), logical)
    assert (
        "weight decay applies to 3 parameters of fewer than two dimensions (biases or norm scales): "
        "blocks.attn_norm.scale, blocks.mlp_norm.scale, final_norm.scale; add patterns" in caplog.text
    )
