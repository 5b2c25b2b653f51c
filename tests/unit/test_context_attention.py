"""Attention with the sequence split over a mesh axis (`jaxpar.parallel.context`): the all-gather K/V (XLA's
masked attention, and the fused kernel's path of two calls per query chunk, `jaxpar.model.context_attention`, here
on its XLA kernel) and ring implementations on the load-balanced layout equal causal attention of the whole
sequence on one device, output and gradients, for c = 2 and 4 devices on an axis named `context`, with grouped-query
heads, and with packed documents that cross chunk boundaries (an odd number of them per row, one longer than a
whole chunk).

Bound: both compute the same sums in another order (blocks, online softmax), in fp32: |sharded - reference| <=
1e-5 x max|reference| per array (a few ulp of the largest element times the number of blocks combined).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.model.attention import dot_product_attention
from jaxpar.model.attention_kernels import XLA_KERNEL
from jaxpar.model.context_attention import gathered_chunk_attention
from jaxpar.model.context_ring import ring_kernel_attention
from jaxpar.parallel.context import ContextParallel, balanced_order, gathered_kv_attention, ring_attention

B, T, H, G, K = 2, 32, 4, 2, 8
REL = 1e-5
# row 0: 3 documents (one of 20 tokens, longer than a chunk of T/(2c) = 8 or 4); row 1: one document
SEGMENTS = np.array([[0] * 5 + [1] * 20 + [2] * 7, [0] * T], np.int32)


def test_balanced_order_gives_each_device_an_early_and_a_late_chunk():
    order = balanced_order(16, 2)
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    assert sorted(balanced_order(32, 4)) == list(range(32))
    with pytest.raises(ValueError, match="does not split into 2 x 4 equal chunks"):
        balanced_order(12, 4)


# one case per path: each implementation at c = 2 and 4, each with and without documents; "chunks" is the fused
# kernel's path (two kernel calls per query chunk, `jaxpar.model.context_attention`) and "ring_kernel" the ring of
# kernel calls (`jaxpar.model.context_ring`), both with the XLA kernel; the ring of kernel calls compiles slowest
# (a kernel call per sub-block and hop), so its 3-hop case with documents runs in the slow suite
@pytest.mark.parametrize(
    "impl,c,packed",
    [
        ("gather", 2, True),
        ("gather", 4, False),
        ("ring", 2, False),
        ("ring", 4, True),
        ("chunks", 2, False),
        ("chunks", 4, True),
        ("ring_kernel", 2, False),
        pytest.param("ring_kernel", 4, True, marks=pytest.mark.slow),
    ],
)
def test_sharded_attention_equals_one_device(impl, c, packed, need_devices):
    need_devices(c)
    keys = jax.random.split(jax.random.key(c), 4)
    q = jax.random.normal(keys[0], (B, T, H, K), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, G, K), jnp.float32)
    v = jax.random.normal(keys[2], (B, T, G, K), jnp.float32)
    d_out = jax.random.normal(keys[3], (B, T, H, K), jnp.float32)
    seg = jnp.asarray(SEGMENTS) if packed else None

    def reference(q, k, v):
        return dot_product_attention(q, k, v, implementation="xla", segment_ids_BT=seg)

    want, vjp = jax.vjp(reference, q, k, v)
    want_grads = vjp(d_out)

    order = balanced_order(T, c)
    inverse = np.argsort(order)
    mesh = Mesh(np.array(jax.devices()[:c]), ("context",))
    spec = P(None, "context")

    def local(q, k, v, pos, seg_):
        seg_ = None if seg is None else seg_
        if impl == "gather":
            return gathered_kv_attention(q, k, v, pos, seg_, "context")
        if impl == "ring_kernel":
            return ring_kernel_attention(q, k, v, pos, seg_, c, XLA_KERNEL, max_segments=4)
        if impl == "chunks":
            return gathered_chunk_attention(q, k, v, seg_, ContextParallel(c), XLA_KERNEL, max_segments=4)
        return ring_attention(q, k, v, pos, seg_, "context", c)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)
    pos = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, T))
    seg_laid = (seg if seg is not None else jnp.zeros((B, T), jnp.int32))[:, order]

    def run(q, k, v):
        return sharded(q[:, order], k[:, order], v[:, order], pos, seg_laid)[:, inverse]

    got, vjp = jax.jit(lambda q, k, v: jax.vjp(run, q, k, v))(q, k, v)
    got_grads = vjp(d_out)
    for name, a, e in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        err = float(jnp.max(jnp.abs(a - e)))
        assert err <= REL * float(jnp.max(jnp.abs(e))), f"{impl} c={c} packed={packed} {name}: {err}"
    # the layouts differ: each device holds two chunks of T/(2c) tokens, not a contiguous slice
    assert not np.array_equal(order, np.arange(T))
