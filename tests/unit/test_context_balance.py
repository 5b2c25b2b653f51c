"""Ring attention's work per device, read from the compiled program (`jaxpar.analysis.bench.context_balance`): with
the load-balanced layout every device's matmul FLOPs (forward and backward) are equal; with the contiguous layout
the last device does several times the first's. And the sub-blocks a packed batch skips.

The FLOPs are XLA's compiled program's dot FLOPs per partition (`jaxpar.analysis.hlo.flops.dot_flops_per_device`),
each sub-block's cond weighted by whether that device computes it (`ring_blocks`, the predicate the cond evaluates,
on the host). c = 4 simulated devices, B 1, T 64, H 4, G 2, K 8.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.bench.context_balance import computed_fraction, ring_blocks, ring_branch_weights
from jaxpar.analysis.hlo.flops import dot_flops_per_device
from jaxpar.parallel.context import balanced_order, ring_attention

C, B, T, H, G, K = 4, 1, 64, 4, 2, 8


@pytest.fixture(scope="module")
def ring_hlo(need_devices) -> str:
    need_devices(C)
    mesh = Mesh(np.array(jax.devices()[:C]), ("context",))
    spec = P(None, "context")

    def local(q, k, v, pos, ct):
        out, vjp = jax.vjp(lambda q, k, v: ring_attention(q, k, v, pos, None, "context", C), q, k, v)
        return out, *vjp(ct)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 4, check_vma=False)
    args = [jax.ShapeDtypeStruct((B, T, H, K), jnp.float32), *[jax.ShapeDtypeStruct((B, T, G, K), jnp.float32)] * 2]
    args += [jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)]
    return jax.jit(fn).lower(*args).compile().as_text()


def _flops(hlo: str, order: np.ndarray) -> np.ndarray:
    blocks = ring_blocks(order, C)
    return np.asarray(dot_flops_per_device(hlo, branch_weights=ring_branch_weights(blocks, list(range(C)))))


def test_balanced_layout_balances_the_ring_and_the_contiguous_one_does_not(ring_hlo):
    balanced = _flops(ring_hlo, balanced_order(T, C))
    contiguous = _flops(ring_hlo, np.arange(T))
    assert balanced.max() / balanced.mean() <= 1.05, balanced
    assert np.ptp(balanced) == 0  # 2c + 1 sub-blocks on every device
    assert contiguous[-1] / contiguous[0] > 3, contiguous  # 4c - 1 against 3 sub-blocks
    # the balanced layout computes no more in all than the contiguous one: the same visible sub-blocks, spread
    assert balanced.sum() <= contiguous.sum()
    assert computed_fraction(ring_blocks(balanced_order(T, C), C)).tolist() == [(2 * C + 1) / (4 * C)] * C


def test_a_packed_batch_skips_the_sub_blocks_of_other_documents():
    rng = np.random.default_rng(0)
    starts = np.sort(rng.choice(np.arange(1, T), size=5, replace=False))
    seg = np.searchsorted(starts, np.arange(T), side="right")[None, :]
    one = ring_blocks(balanced_order(T, C), C).sum()
    packed = ring_blocks(balanced_order(T, C), C, seg).sum()
    assert packed < one == C * (2 * C + 1)
