"""`DivergenceHook` at the last step: a run never ends diverged. The hook is driven with host metrics and a
two-element parameter tree; no model is built or compiled (only the one-line finiteness reduction)."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.training.hooks import resilience
from jaxpar.training.hooks.resilience import DivergenceHook, TrainingDiverged

NAN, INF = float("nan"), float("inf")
FINITE = {"w": jnp.ones((2,))}


def _run(steps: int, checkpointer=None, rollbacks: int = 0):
    purged, logged = [], []
    run = SimpleNamespace(
        cfg=SimpleNamespace(train=SimpleNamespace(steps=steps)),
        checkpointer=checkpointer,
        rollbacks=0,
        plan=None,
        writer=SimpleNamespace(purge=purged.append),
        log=logged.append,
    )
    return run, DivergenceHook(max_bad_steps=10, rollbacks=rollbacks), purged, logged


def _drive(hook, run, losses, bad, last_params=FINITE):
    """Runs the hook over steps 1..len(losses) with those losses and bad_steps_in_a_row counters; returns what
    the last call returned."""
    hook.on_start(run)
    out = None
    for step, (loss, b) in enumerate(zip(losses, bad, strict=True), 1):
        params = last_params if step == len(losses) else FINITE
        metrics = {"loss": np.float32(loss), "bad_steps_in_a_row": np.int32(b)}
        out = hook.on_step(run, step, {"step": step, "params": params}, metrics)
    return out


@pytest.mark.parametrize(
    "losses, bad, last_params, message",
    [
        ([2.0, NAN, NAN], [0, 1, 2], FINITE, "its loss has been NaN or inf since step 2"),
        ([2.0, 2.1, 2.1], [0, 1, 2], FINITE, "its gradients have been NaN or inf (updates skipped) since step 2"),
        ([2.0, 2.0, 1.9], [0, 0, 0], {"w": jnp.array([1.0, INF])}, "the parameters are NaN or inf after its update"),
        ([NAN, 2.0, 1.9], [1, 0, 0], FINITE, None),  # a skipped update it recovered from: the run ends as usual
    ],
    ids=["loss", "gradients", "parameters", "recovered"],
)
def test_a_run_that_would_end_diverged_stops_naming_the_step_and_the_fix(losses, bad, last_params, message):
    run, hook, _, _ = _run(steps=len(losses))
    if message is None:
        assert _drive(hook, run, losses, bad, last_params) is None
        return
    with pytest.raises(TrainingDiverged) as err:
        _drive(hook, run, losses, bad, last_params)
    text = str(err.value)
    assert text.startswith(f"the run reached its last step, 3, diverged: {message}"), text
    assert "no checkpoint was saved. Lower optimizer.learning_rate, raise train.divergence_rollbacks" in text
    assert "\n" not in text


def test_a_run_that_would_end_diverged_rolls_back_while_rollbacks_remain(monkeypatch):
    restored = {"step": 2, "params": FINITE}
    ckpt = SimpleNamespace(
        all_steps=lambda: [2], wait=lambda: None, latest_step=lambda: 2, restore=lambda *a: (restored, None, None)
    )
    monkeypatch.setattr(resilience, "abstract_state", lambda plan: None)
    run, hook, purged, logged = _run(steps=3, checkpointer=ckpt, rollbacks=1)
    assert _drive(hook, run, [2.0, 2.0, NAN], [0, 0, 1]) is restored
    assert run.rollbacks == 1 and purged == [3]
    assert logged[-1].startswith("diverged: the run reached its last step, 3, diverged: its loss has been NaN")
    assert "rolled back to step 2 (1/1 train.divergence_rollbacks)" in logged[-1]
