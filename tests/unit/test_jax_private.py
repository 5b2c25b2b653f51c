"""The private jax names of jaxpar.parallel.jax_private still exist and do what its docstring says, so a jax
upgrade that moves or changes one fails here, naming it, rather than deep inside a step."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from jaxpar.parallel import jax_private


def test_jaxpr_tools_evaluate_and_prune():
    """convert_constvars_jaxpr puts the constants first, dce_jaxpr keeps what an output reads, eval_jaxpr runs it."""
    c = jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda x, y: (x * c, y + 1.0))(jnp.ones(3), jnp.ones(3))
    jaxpr = jax_private.convert_constvars_jaxpr(closed.jaxpr)
    assert len(jaxpr.invars) == len(closed.consts) + 2 and not jaxpr.constvars
    pruned, used = jax_private.dce_jaxpr(jaxpr, [True, False])
    assert used == [True] * len(closed.consts) + [True, False]
    (out,) = jax_private.eval_jaxpr(pruned, (), *closed.consts, jnp.full(3, 2.0))
    assert out.tolist() == [0.0, 2.0, 4.0]


def test_cudnn_attention_takes_segment_offsets():
    attention, mask_type = jax_private.cudnn_attention()
    params = inspect.signature(attention).parameters
    assert {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type", "qkv_layout"} <= set(params)
    assert hasattr(mask_type, "PADDING_CAUSAL")


def test_cudnn_attention_parts_return_and_take_the_softmax_statistics():
    attention, backward, mask_type, layout = jax_private.cudnn_attention_parts()
    assert "return_residual" in inspect.signature(attention).parameters
    # the backward rule's arguments: the custom VJP's 9 static ones, then the residuals and the output cotangent
    assert list(inspect.signature(backward).parameters)[-2:] == ["res", "grad_output"]
    assert len(inspect.signature(backward).parameters) == 11
    assert {"CAUSAL", "PADDING", "PADDING_CAUSAL", "NO_MASK"} <= set(mask_type.__members__) and layout == 0


def test_distributed_client_is_none_in_one_process():
    assert jax.process_count() == 1 and jax_private.distributed_client() is None


def test_cudnn_compute_capability_answers_for_the_target_and_restores():
    """Inside, jax's cuDNN capability checks answer for the given GPU (here a CPU process has none: False
    outside); the module's own functions are back on exit."""
    before = jax_private.cudnn_capability_checks()
    with jax_private.cudnn_compute_capability((9, 0)):
        at_least, equal = jax_private.cudnn_capability_checks()
        assert at_least("9.0") and not at_least("10.0")
        assert equal("9.0") and not equal("10.3")
    assert jax_private.cudnn_capability_checks() == before and not before[0]("9.0")
