"""Analytic communication volume: ring-algorithm bytes per device, and the Megatron tensor-parallel traffic of a step.

Shape letters: b microbatch rows per device, s sequence length, h model width (d_model), L layers,
A gradient-accumulation microbatches, t tensor-parallel size.

Ring costs (bytes sent per device; NCCL tests, doc/PERFORMANCE.md, "bus bandwidth"), n = group size:

    all-reduce       2(n-1)/n * S
    all-gather        (n-1)/n * S    S = the gathered (output) size
    reduce-scatter    (n-1)/n * S    S = the input size
    all-to-all        (n-1)/n * S
    collective-permute        S      each device sends its whole operand once

Megatron tensor parallelism (Shoeybi et al. 2019, arXiv 1909.08053, section 3; Korthikanti et al. 2022,
arXiv 2205.05198, section 4.2): per layer 2 all-reduces of b*s*h activations in forward and 2 in backward; with
sequence parallelism each all-reduce becomes an all-gather + a reduce-scatter of the same total bytes.
`tensor_parallel_bytes` adds the terms jaxpar's model has around the layers (see its docstring).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def ring_bytes(kind: str, size_bytes: float, n: int) -> float:
    """Bytes sent per device by one ring collective over a group of `n` devices (table in the module docstring).

    Args:
      kind: one of `KINDS`.
      size_bytes: S in the table: the all-reduce/all-to-all/permute operand, the all-gather output, the
        reduce-scatter input, in bytes.
      n: devices per replica group; n = 1 moves nothing.

    Raises:
      ValueError: unknown kind or n < 1.
    """
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * size_bytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n * size_bytes
    if kind == "collective-permute":
        return float(size_bytes) if n > 1 else 0.0
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")


@dataclasses.dataclass(frozen=True)
class Term:
    """One analytic contribution: `count` collectives of `kind`, each over `size_bytes` (S in the ring table)."""

    name: str
    kind: str
    count: int
    size_bytes: float

    def bytes_per_device(self, n: int) -> float:
        return self.count * ring_bytes(self.kind, self.size_bytes, n)


def tensor_parallel_terms(*, rows: int, seq_len: int, d_model: int, n_layers: int, microbatches: int,
                          tensor: int, sequence_parallel: bool, compute_dtype, reduce_dtype=jnp.float32,
                          fsdp_shards: int = 1, remat: str = "none") -> list[Term]:
    """The collectives over the `tensor` axis of one jaxpar train step (forward + backward), as `Term`s.

    Args:
      rows: b, microbatch rows per device; seq_len: s; d_model: h; n_layers: L; microbatches: A.
      tensor: t; sequence_parallel: Korthikanti et al. sequence parallelism on or off.
      compute_dtype: dtype of the activations (b*s*h collectives); reduce_dtype: of the norm-gradient reduction.
      fsdp_shards: number of shards a norm-scale gradient is split into when it is all-reduced over tensor
        (fsdp, times data under ZeRO-3); only used with sequence parallelism.
      remat: `model.remat`; `full` recomputes the forward of each block in the backward, which re-runs the
        collectives whose results the backward needs (the attention exit and, with SP, both enters).

    Terms (per microbatch, except the last), B = bytes of compute_dtype, x = b*s*h*B:
      layers: L * 4 all-reduces of x (2 forward at the attention/MLP exits, 2 backward at their enters, Megatron
        f/g); with SP L * 4 all-gathers of x (gathered size) and L * 4 reduce-scatters of x (input size).
      embedding + head: the vocab-parallel embedding's exit (forward) and the head's enter (backward):
        2 all-reduces of x; with SP 2 reduce-scatters (embedding forward, head backward) + 2 all-gathers.
      cross-entropy: pmax and two psums of [b, s] fp32 statistics: 3 all-reduces of b*s*4 bytes.
      norm gradients (SP only, once per step): the tensor-replicated norm scales saw 1/t of the sequence, their
        gradients (reduce_dtype) (2L + 1 vectors of h / fsdp_shards) are all-reduced over tensor: one all-reduce.
    Not included: the optimizer's global gradient norm, whose per-parameter scalar partial sums the compiler
    all-reduces over tensor (a few bytes; the bench reports the HLO total, which includes them).

    Raises:
      ValueError: remat not one of none, full (dots saves an XLA-chosen set, so its recompute is not analytic).
    """
    if remat not in ("none", "full"):
        raise ValueError(f"remat={remat!r}: the analytic count covers remat none and full only")
    if tensor <= 1:
        return []
    x = rows * seq_len * d_model * jnp.dtype(compute_dtype).itemsize
    a, layers = microbatches, n_layers
    if sequence_parallel:
        # remat full re-runs the attention enter (all-gather), its exit (reduce-scatter) and the MLP enter.
        extra_ag, extra_rs = (2, 1) if remat == "full" else (0, 0)
        terms = [Term("layers", "all-gather", a * layers * (4 + extra_ag), x),
                 Term("layers", "reduce-scatter", a * layers * (4 + extra_rs), x),
                 Term("embedding+head", "all-gather", a * 2, x),
                 Term("embedding+head", "reduce-scatter", a * 2, x),
                 Term("norm grads", "all-reduce", 1,
                      (2 * layers + 1) * d_model // fsdp_shards * jnp.dtype(reduce_dtype).itemsize)]
    else:
        # remat full re-runs the attention exit; the MLP exit only feeds the block output, dead in the backward.
        extra = 1 if remat == "full" else 0
        terms = [Term("layers", "all-reduce", a * layers * (4 + extra), x),
                 Term("embedding+head", "all-reduce", a * 2, x)]
    terms.append(Term("cross-entropy", "all-reduce", a * 3, rows * seq_len * 4))
    return terms


def tensor_parallel_bytes(terms: list[Term], tensor: int) -> dict[str, float]:
    """Bytes per device per step of each collective kind over `tensor`, summed over `terms`."""
    out: dict[str, float] = {}
    for term in terms:
        out[term.kind] = out.get(term.kind, 0.0) + term.bytes_per_device(tensor)
    return out
