"""A ragged all-to-all over mesh axes, for use inside shard_map: `jax.lax.ragged_all_to_all` where the backend has
it (GPU, TPU), else an emulation with the same semantics (XLA:CPU has no ragged-all-to-all).

Shape letters: n the size of `axes` (the product of their sizes, ranks ordered major to minor as
`jax.lax.axis_index(axes)`), I = n * j slices (j per destination rank), X operand rows, Y output rows, P = min(X, Y).

Semantics (`jax.lax.ragged_all_to_all`'s docstring): each device sends slice i of its operand, rows
[input_offsets[i], input_offsets[i] + send_sizes[i]), to rank i // j, which writes them at rows
[output_offsets[i], output_offsets[i] + send_sizes[i]) of its result: the sender says where its rows land. Each
result is that device's `output` with every received slice written at its sender's offset and every other row
untouched; `recv_sizes[i]` is the size of the slice it receives from rank i // j (that rank's (i % j)-th slice to
this device) and must equal the sender's `send_sizes`. Slices written on one device must not overlap.

The emulation moves a padded buffer: slice i gathered into row i of [I, P, ...] (P rows, the most a valid slice
can hold: it fits in the sender's operand and in the receiver's output; rows past send_sizes[i] zero), one dense
`jax.lax.all_to_all` of that buffer and one of `output_offsets` (I int32), then one scatter into `output`. It
therefore sends n * j * P rows per device, against the ragged op's sum(send_sizes). Both are built from
differentiable ops: the ragged op's transpose is a ragged all-to-all in the other direction (jax's rule), the
emulation's is its gathers', all-to-all's and scatter's.

Multiple axes: `jax.lax.ragged_all_to_all` takes a tuple of axis names (its lowering builds the replica groups
over all of them, as `jax.lax.all_to_all`'s does), so `axes` is passed through as is on both paths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axes: tuple[str, ...],
    *,
    emulate: bool,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` over the mesh axes `axes` (module docstring), or its emulation.

    Args:
      operand: the rows to send [X, ...], any dtype.
      output: [Y, ...], operand's dtype and trailing shape: the result's rows that no received slice writes.
      input_offsets, send_sizes, output_offsets, recv_sizes: int32 [I], I a multiple of n (module docstring).
      axes: mesh axis names, major to minor; inside shard_map over them.
      emulate: False calls `jax.lax.ragged_all_to_all` (GPU, TPU); True runs the emulation (any backend).

    Returns:
      [Y, ...]: `output` with the received slices written at their senders' output offsets.

    Raises:
      ValueError: I is not a multiple of n, or output's trailing shape or dtype differ from operand's.
    """
    n = jax.lax.axis_size(axes)
    i = input_offsets.shape[0]
    if i % n or not i:
        raise ValueError(f"ragged_all_to_all: {i} slices do not split over {n} ranks of axes {axes}")
    if output.shape[1:] != operand.shape[1:] or output.dtype != operand.dtype:
        raise ValueError(
            f"ragged_all_to_all: output {output.dtype}{list(output.shape)} does not match operand "
            f"{operand.dtype}{list(operand.shape)} beyond its leading dimension"
        )
    if not emulate:
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes
        )
    p = min(operand.shape[0], output.shape[0])  # the most rows a valid slice holds
    rows_P = jnp.arange(p, dtype=jnp.int32)
    rest = operand.shape[1:]
    # Sender: slice i into row i of the padded buffer [I, P, ...], zeros past its size.
    sent_IP = rows_P[None, :] < send_sizes[:, None]
    src_IP = jnp.where(sent_IP, input_offsets[:, None] + rows_P[None, :], 0)
    mask = sent_IP.reshape(i, p, *(1,) * len(rest))
    buf = jnp.where(mask, operand[src_IP], jnp.zeros((), operand.dtype))
    # all-to-all over `axes`: the j slices for rank r travel to r; received [I, P, ...] in source-rank order, slice
    # s * j + c being source s's c-th slice to this device, as recv_sizes and the offsets index them.
    recv = _dense_all_to_all(buf, n, axes)
    at_I = _dense_all_to_all(output_offsets, n, axes)  # where each received slice goes, as its sender said
    # Receiver: every received row to output row at_I[i] + p; rows past recv_sizes[i] to row Y (dropped).
    y = output.shape[0]
    dst_IP = jnp.where(rows_P[None, :] < recv_sizes[:, None], at_I[:, None] + rows_P[None, :], y)
    return output.at[dst_IP.reshape(-1)].set(recv.reshape(i * p, *rest), mode="drop")


def _dense_all_to_all(x: jax.Array, n: int, axes: tuple[str, ...]) -> jax.Array:
    """`jax.lax.all_to_all` of x's leading dimension (a multiple of n) split in n equal parts: part r goes to rank
    r and the parts received are stacked in rank order. Sent flat, [n, everything else]: XLA:CPU's all-to-all
    combiner fails its verifier on two high-rank all-to-alls of different layouts."""
    flat = jax.lax.all_to_all(x.reshape(n, -1), axes, 0, 0, tiled=True)
    return flat.reshape(x.shape)
