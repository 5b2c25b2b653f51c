"""Hugging Face weights read by the block: `HFSliceReader.read` returns the block of one jaxpar parameter that one
device holds, reading only the slices of the Hugging Face tensors it comes from; `hf_sources` is the map between the
two, which export walks the other way. Pure numpy; placing the blocks on devices is `jaxpar.model.hf.place`.

A block is given by its bounds, one [start, stop) per jaxpar axis (of the parameter's full shape). The stacked
`blocks/...` parameters lead with the stack's row r (HF layer i of row r: `jaxpar.model.hf.weights.layer_places`;
DeepSeek-V3's dense first blocks first_dense_i/... are unstacked, one HF layer each) and, for Mixtral's and
DeepSeek-V3's experts, the expert e; the rest of the bounds cut each layer's tensor by its kind (K head width;
`_to_jaxpar` in `jaxpar.model.hf.weights` is the whole-tensor form of the same map):

    kind        jaxpar block (one layer)      read from the HF tensor
    vector      [n0:n1] (or [v0:v1, d0:d1])   the same rectangle (model.embed_tokens.weight is one too)
    linear      [a0:a1, b0:b1]  (in, out)     [b0:b1, a0:a1], transposed
    bias        [h0:h1, k0:k1]                elements h*K + k0 .. h*K + k1 for each head h (one run if k is whole)
    in_heads    [d0:d1, h0:h1, k0:k1]         rows as bias's elements, columns [d0:d1]; transposed, split (h, k)
    heads_out   [h0:h1, k0:k1, d0:d1]         rows [d0:d1], columns as bias's elements; transposed, split (h, k)

lm_head/kernel is `linear` of lm_head.weight and final_norm/scale `vector` of model.norm.weight. Multi-head Latent
Attention's kinds are these with their own head widths (`jaxpar.model.hf.weights.tensor_layout`); where the rotary
columns are stored in DeepSeek's interleaved pairs, the block's last axis is read whole, reordered, then cut. A kind
not listed (a family's own) reads the whole per-layer tensor and cuts the block out of `_to_jaxpar`'s result. bf16
and fp16 upcast to float32 exactly.
"""

from __future__ import annotations

import collections
import logging
from typing import NamedTuple

import numpy as np

from jaxpar.config.schema import ModelConfig
from jaxpar.model.hf.files import TensorFiles
from jaxpar.model.hf.weights import (
    _to_jaxpar,
    check_hf_tensors,
    hf_tensor_shapes,
    layer_places,
    stored_rope_interleave,
    tensor_layout,
)

_LOGGER = logging.getLogger("jaxpar.model.hf")
Bounds = tuple[tuple[int, int], ...]  # [start, stop) per axis of a jaxpar parameter


class HFSource(NamedTuple):
    """One Hugging Face tensor and where it lives in jaxpar's parameters: `path` (from the tree's root), the stack
    row `row` and expert `expert` within it (None for an unstacked parameter or a non-expert tensor), and `kind`."""

    name: str
    path: tuple[str, ...]
    row: int | None
    expert: int | None
    kind: str


def hf_sources(cfg: ModelConfig, rope_interleave: bool = True) -> list[HFSource]:
    """Every tensor of a Hugging Face model of `cfg` in `hf_tensor_shapes`' order, with where it lives in jaxpar's
    parameter tree (`rope_interleave`: MLA's rotary columns stored in DeepSeek's interleaved pairs, as an export
    writes them: `jaxpar.model.hf.weights.layer_places`)."""
    out = [HFSource("model.embed_tokens.weight", ("embed", "table"), None, None, "vector")]
    for place in layer_places(cfg, rope_interleave):
        out += [
            HFSource(f"model.layers.{place.layer}.{e.suffix}", (*place.prefix, *e.path), place.row, e.expert, e.kind)
            for e in place.entries
        ]
    out.append(HFSource("model.norm.weight", ("final_norm", "scale"), None, None, "vector"))
    if not cfg.tie_embeddings:
        out.append(HFSource("lm_head.weight", ("lm_head", "kernel"), None, None, "linear"))
    return out


class _Leaf(NamedTuple):
    kind: str
    names: dict[tuple[int | None, int | None], str]  # (row, expert) -> HF tensor name
    stacked: bool
    experts: bool


def _head_runs(heads: tuple[int, int], within: tuple[int, int], k: int) -> list[tuple[int, int]]:
    """The element runs of heads [h0, h1) x head elements [k0, k1) in a [heads * K] axis."""
    (h0, h1), (k0, k1) = heads, within
    if (k0, k1) == (0, k):
        return [(h0 * k, h1 * k)]
    return [(h * k + k0, h * k + k1) for h in range(h0, h1)]


class HFSliceReader:
    """Reads the blocks of jaxpar parameters from a Hugging Face directory, slice by slice (module docstring).

    Args:
      hf_dir: config.json + safetensors of a model of `cfg` (`jaxpar.model.hf.check_hf` gives `cfg`).
      cfg: the model.
      backend: how the files are read (`jaxpar.model.hf.files.TensorFiles`): "safetensors" (its `get_slice`, the
        default) or "pread".

    Attributes:
      stored_dtype: the dtype the weights are stored in ("float32", "bfloat16", "float16"; the most common if mixed).

    Raises:
      HFConfigError: tensors that do not fit `cfg` (`check_hf_tensors`: headers only, before any read).
    """

    def __init__(self, hf_dir: str, cfg: ModelConfig, *, backend: str = "safetensors"):
        self.hf_dir, self.cfg = hf_dir, cfg
        files = check_hf_tensors(hf_dir, cfg)
        want = hf_tensor_shapes(cfg)
        self._files = TensorFiles({n: files[n] for n in want}, backend)
        counts = collections.Counter(self._files.info(n).dtype.name for n in want)
        self.stored_dtype = counts.most_common(1)[0][0]
        self._total = sum(int(np.prod(s)) * self._files.info(n).dtype.itemsize for n, s in want.items())
        self._leaves: dict[tuple[str, ...], _Leaf] = {}
        for s in hf_sources(cfg, stored_rope_interleave(hf_dir, cfg)):
            leaf = self._leaves.setdefault(s.path, _Leaf(s.kind, {}, s.row is not None, s.expert is not None))
            leaf.names[(s.row, s.expert)] = s.name

    @property
    def bytes_read(self) -> int:
        """Bytes read from the files so far (the slices, in the stored dtype)."""
        return self._files.bytes_read

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor of the model in the files."""
        return self._total

    def paths(self) -> list[tuple[str, ...]]:
        """The paths (from the parameter tree's root) of every jaxpar parameter the directory holds."""
        return list(self._leaves)

    def read(self, path: tuple[str, ...], bounds: Bounds) -> np.ndarray:
        """The block `bounds` of jaxpar parameter `path`: a C-contiguous float32 array of the bounds' extents. Rows
        of the layer stack past the model's layers (a stack stored over pipeline stages that do not divide it,
        `jaxpar.parallel.layer_split.stored_rows`) read as zeros.

        Raises:
          KeyError: `path` is not a parameter of the model. ValueError: bounds of the wrong rank or outside it.
        """
        leaf = self._leaves[path]
        if not leaf.stacked:
            return self._read_tensor(leaf.names[(None, None)], leaf.kind, bounds)
        lead = 2 if leaf.experts else 1
        rows = range(*bounds[0])
        experts: list[int | None] = list(range(*bounds[1])) if leaf.experts else [None]
        out: np.ndarray | None = None
        depth = self.cfg.stack_depth
        if rows.stop > depth:  # the stack stored with zero rows after its last layer (jaxpar.parallel.layer_split)
            extents = [b - a for a, b in bounds]
            out = np.zeros(extents, np.float32)
            if rows.start < depth:
                out[: depth - rows.start] = self.read(path, ((rows.start, depth), *bounds[1:]))
            return out
        for j, row in enumerate(rows):
            for k, expert in enumerate(experts):
                block = self._read_tensor(leaf.names[(row, expert)], leaf.kind, bounds[lead:])
                if out is None:
                    out = np.empty((len(rows), *([len(experts)] if leaf.experts else []), *block.shape), np.float32)
                out[(j, k) if leaf.experts else j] = block
        if out is None:
            raise ValueError(f"{'/'.join(path)}: empty bounds {bounds}")
        return out

    def _read_tensor(self, name: str, kind: str, bounds: Bounds) -> np.ndarray:
        """One layer's block of kind `kind` (module docstring) from HF tensor `name`, float32."""
        plain, k, order = tensor_layout(kind, self.cfg)
        if order is None:
            return self._read_plain(name, plain, k, bounds)
        # the last axis stored in another order (MLA's interleaved rotary columns): read it whole, reorder, cut
        whole_last = self._read_plain(name, plain, k, (*bounds[:-1], (0, len(order))))[..., order]
        return np.ascontiguousarray(whole_last[..., bounds[-1][0] : bounds[-1][1]])

    def _read_plain(self, name: str, kind: str, k: int, bounds: Bounds) -> np.ndarray:
        """`_read_tensor` of a kind laid out as the module docstring's table, heads of width `k`."""
        read = self._files.read
        size = [b - a for a, b in bounds]
        if kind == "vector":
            return read(name, [bounds[0]], list(bounds[1:]) or None).astype(np.float32)
        if kind == "linear":
            return np.ascontiguousarray(read(name, [bounds[1]], [bounds[0]]).T, dtype=np.float32)
        if kind == "bias":
            return read(name, _head_runs(bounds[0], bounds[1], k)).astype(np.float32).reshape(size)
        if kind == "in_heads":
            raw = read(name, _head_runs(bounds[1], bounds[2], k), [bounds[0]])
            return np.ascontiguousarray(raw.T, dtype=np.float32).reshape(size)
        if kind == "heads_out":
            raw = read(name, [bounds[2]], _head_runs(bounds[0], bounds[1], k))
            return np.ascontiguousarray(raw.T, dtype=np.float32).reshape(size)
        _LOGGER.debug("%s: kind %r is read whole, then cut", name, kind)
        info = self._files.info(name)
        whole = read(name, [(0, info.shape[0])])
        w = _to_jaxpar(whole.astype(np.float32), kind, self.cfg)
        return np.ascontiguousarray(w[tuple(slice(a, b) for a, b in bounds)])

    def close(self) -> None:
        """Closes the files."""
        self._files.close()

    def __enter__(self) -> HFSliceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
