"""Context parallelism's fused-kernel path checked on one GPU (`benchmarks/gpu_acceptance.py` runs it): a query
chunk of the load-balanced layout as two cuDNN calls (`jaxpar.model.context_attention`), against the same path
on the XLA kernel in fp32 and against whole-sequence attention.

No mesh is needed: one chunk's computation (`_chunk`) takes the whole sequence's keys in natural order, which is
what the all-gather leaves on every device; the chunk index plays the device's. Shape letters as in
`jaxpar.model.context_attention`; bytes per device, times in seconds.

1. `kernel_parity`: for chunks 0 (no prefix), a middle one and the last (the longest prefix), with and without
   packed documents: the output and the gradients of q, k and v (bf16 on cuDNN) against the XLA kernel on the
   same inputs in fp32, as max |a - e| / max |e|; and the XLA kernel's output against XLA's whole-sequence
   attention (the decomposition itself). And every kind of call the context-parallel paths make (the ring's too),
   one by one: cuDNN's output, log-sum-exp and gradients against the XLA kernel's (`call_parity`).
2. `chunk_times`: forward + backward time of each chunk on cuDNN at a long sequence, and per device of c (chunks
   i and 2c - 1 - i): the load balance on the real kernel, and whether a short prefix pays for the padded one.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model.attention import dot_product_attention
from jaxpar.model.attention_kernels import CUDNN_KERNEL, XLA_KERNEL, Call, Kernel
from jaxpar.model.context_attention import _chunk


def _documents(b: int, t: int, seed: int) -> np.ndarray:
    """int32 [b, t] segment ids: random document lengths from 1 to t/3 (row 0 one document)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((b, t), np.int32)
    for row in range(1, b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=rng.integers(2, 9), replace=False))
        ids[row] = np.searchsorted(cuts, np.arange(t), side="right")
    return ids


def _inputs(shape, seed: int):
    b, t, h, g, k = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, h, k), jnp.float32)
    kk = jax.random.normal(keys[1], (b, t, g, k), jnp.float32)
    v = jax.random.normal(keys[2], (b, t, g, k), jnp.float32)
    d_out = jax.random.normal(keys[3], (b, t, h, k), jnp.float32)
    return q, kk, v, d_out


def _chunk_grads(kernel: Kernel, q_all, k_all, v_all, seg, d_out, chunk: int, n: int, dtype, max_segments: int):
    """(out, dq, dk, dv) of query chunk `chunk` (n queries) in `dtype`, as fp32 numpy arrays."""

    def run(q, k, v):
        q_chunk = jax.lax.dynamic_slice_in_dim(q, chunk * n, n, axis=1)
        return _chunk(q_chunk, k, v, seg, jnp.int32(chunk), kernel, max_segments)

    cast = [x.astype(dtype) for x in (q_all, k_all, v_all)]
    d_chunk = jax.lax.dynamic_slice_in_dim(d_out, chunk * n, n, axis=1).astype(dtype)
    out, vjp = jax.jit(lambda q, k, v: jax.vjp(run, q, k, v))(*cast)
    grads = vjp(d_chunk)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _rel(a, e) -> float:
    return float(np.max(np.abs(a - e)) / max(float(np.max(np.abs(e))), 1e-30))


def kernel_parity(shape=(2, 2048, 8, 2, 128), c: int = 4, seed: int = 0, kernels=("cudnn",)) -> dict:
    """{case: {"out", "dq", "dk", "dv": relative error of the kernel's chunk path against the XLA kernel's in fp32},
    and "decomposition" (the XLA kernel's chunk output against whole-sequence attention, fp32), "calls"
    (`call_parity`: every kind of kernel call the context-parallel paths make, cuDNN against the XLA kernel)}.
    `shape` is (B, T, H, G, K), T divisible by 2c. `kernels` ("cudnn" on a GPU; () on CPU: only the decomposition
    is checked)."""
    b, t, h, g, k = shape
    n = t // (2 * c)
    q, kk, v, d_out = _inputs(shape, seed)
    report: dict = {}
    for packed in (False, True):
        seg = jnp.asarray(_documents(b, t, seed)) if packed else None
        whole = dot_product_attention(q, kk, v, implementation="xla", segment_ids_BT=seg)
        for chunk in (0, c, 2 * c - 1):
            case = f"chunk{chunk}_{'documents' if packed else 'one_document'}"
            ref = _chunk_grads(XLA_KERNEL, q, kk, v, seg, d_out, chunk, n, jnp.float32, max_segments=64)
            row: dict = {"decomposition": _rel(ref[0], np.asarray(whole[:, chunk * n : (chunk + 1) * n]))}
            for name in kernels:
                kernel = {"cudnn": CUDNN_KERNEL, "xla": XLA_KERNEL}[name]
                got = _chunk_grads(kernel, q, kk, v, seg, d_out, chunk, n, jnp.bfloat16, max_segments=64)
                row[name] = {key: _rel(a, e) for key, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
            report[case] = row
    if "cudnn" in kernels:
        report["calls"] = call_parity(q, kk, v, d_out, n, seed)
    return report


def _padded(b: int, n: int) -> Call:
    """Queries [0, n/2) see keys [0, n/3), the rest nothing."""
    return Call(q_lengths=jnp.full((b,), n // 2, jnp.int32), kv_lengths=jnp.full((b,), n // 3, jnp.int32))


def call_parity(q, kk, v, d_out, n: int, seed: int) -> dict:
    """Every kind of call the context-parallel paths make, on cuDNN against the XLA kernel in fp32 on the same bf16
    inputs: {kind: {"lse": max |difference| of the log-sum-exps (nats), "out", "dq", "dk", "dv": relative errors}}
    over the queries that see some key. Kinds: causal (a diagonal block), packed_causal (a diagonal block with
    documents), padded (a prefix or a past block cut by lengths), full (a past block without documents)."""
    from jaxpar.model.attention import packed_segments

    b = q.shape[0]
    qc, kc, vc, dc = (x[:, :n].astype(jnp.bfloat16) for x in (q, kk, v, d_out))
    offsets, lengths, _ = packed_segments(jnp.asarray(_documents(b, n, seed + 1)), 64)
    calls = {
        "causal": (Call(), True),
        "packed_causal": (Call(offsets=offsets, lengths=lengths), True),
        "padded": (_padded(b, n), False),
        "full": (Call(), False),
    }
    out = {}
    for name, (call, causal) in calls.items():

        def run(kernel, q, k, v, d, call=call, causal=causal):
            o, lse = kernel.forward(q, k, v, call, causal)
            return (o, lse, *kernel.backward(q, k, v, o, lse, d, call, causal))

        got = jax.jit(functools.partial(run, CUDNN_KERNEL))(qc, kc, vc, dc)
        want = run(XLA_KERNEL, *(x.astype(jnp.float32) for x in (qc, kc, vc, dc)))
        got, want = ([np.asarray(x, np.float32) for x in r] for r in (got, want))
        rows = np.broadcast_to(np.arange(n)[None, :] < (n if call.q_lengths is None else n // 2), (b, n))
        keys = np.broadcast_to(np.arange(n)[None, :] < (n if call.kv_lengths is None else n // 3), (b, n))
        row = {"lse": float(np.max(np.abs(got[1][rows] - want[1][rows])))}
        for key, i, mask in (("out", 0, rows), ("dq", 2, rows), ("dk", 3, keys), ("dv", 4, keys)):
            row[key] = _rel(got[i][mask], want[i][mask])
        out[name] = row
    return out


def chunk_times(shape=(1, 65536, 32, 8, 128), c: int = 8, reps: int = 3) -> dict:
    """{"chunk_s": [fwd + bwd seconds of each of the 2c chunks on cuDNN], "device_s": [chunks i and 2c - 1 - i for
    each device i], "max_over_mean": the busiest device over the mean}, bf16, one document per row."""
    b, t, h, g, k = shape
    n = t // (2 * c)
    q, kk, v, d_out = (x.astype(jnp.bfloat16) for x in _inputs(shape, 0))

    def step(q, k, v, d, chunk):
        def run(q_chunk, k, v):
            return _chunk(q_chunk, k, v, None, chunk, CUDNN_KERNEL, 64)

        q_chunk = jax.lax.dynamic_slice_in_dim(q, chunk * n, n, axis=1)
        out, vjp = jax.vjp(run, q_chunk, k, v)
        return vjp(jax.lax.dynamic_slice_in_dim(d, chunk * n, n, axis=1))

    fn = jax.jit(step)
    times = []
    for chunk in range(2 * c):
        arg = jnp.int32(chunk)
        jax.block_until_ready(fn(q, kk, v, d_out, arg))
        start = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(fn(q, kk, v, d_out, arg))
        times.append((time.perf_counter() - start) / reps)
    device = [times[i] + times[2 * c - 1 - i] for i in range(c)]
    return {"chunk_s": times, "device_s": device, "max_over_mean": max(device) / float(np.mean(device))}
