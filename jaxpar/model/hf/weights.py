"""Hugging Face safetensors <-> jaxpar parameter dicts (numpy, host memory), for the families of
`jaxpar.model.hf.config`.

Name and layout map (L layers stacked on jaxpar's leading axis; HF `nn.Linear` weights are [out, in], jaxpar's
kernels [in, out]; D width, H/G query/key-value heads, K head width, F MLP width, E experts, V vocabulary):

    model.embed_tokens.weight              [V, D]       embed/table              [V, D]
    model.layers.i.input_layernorm.weight  [D]          blocks/attn_norm/scale   [L, D]
    model.layers.i.self_attn.q_proj.weight [H*K, D]     blocks/attn/wq           [L, D, H, K]
    model.layers.i.self_attn.k_proj.weight [G*K, D]     blocks/attn/wk           [L, D, G, K]
    model.layers.i.self_attn.v_proj.weight [G*K, D]     blocks/attn/wv           [L, D, G, K]
    model.layers.i.self_attn.o_proj.weight [D, H*K]     blocks/attn/wo           [L, H, K, D]
    model.layers.i.post_attention_layernorm.weight      blocks/mlp_norm/scale    [L, D]
    model.layers.i.mlp.gate_proj.weight    [F, D]       blocks/mlp/w_gate        [L, D, F]
    model.layers.i.mlp.up_proj.weight      [F, D]       blocks/mlp/w_up          [L, D, F]
    model.layers.i.mlp.down_proj.weight    [D, F]       blocks/mlp/w_down        [L, F, D]
    model.norm.weight                      [D]          final_norm/scale         [D]
    lm_head.weight                         [V, D]       lm_head/kernel           [D, V]   (absent when tied)
  qwen2:
    model.layers.i.self_attn.q_proj.bias   [H*K]        blocks/attn/bq           [L, H, K]
    model.layers.i.self_attn.{k,v}_proj.bias [G*K]      blocks/attn/{bk,bv}      [L, G, K]
  qwen3:
    model.layers.i.self_attn.q_norm.weight [K]          blocks/attn/q_norm/scale [L, K]
    model.layers.i.self_attn.k_norm.weight [K]          blocks/attn/k_norm/scale [L, K]
  mixtral (every block an MoE block: jaxpar's blocks/moe/..., attention and norms as above beneath it):
    model.layers.i.block_sparse_moe.gate.weight          [E, D]   blocks/moe/mlp/router  [L, D, E]
    model.layers.i.block_sparse_moe.experts.e.w1.weight  [F, D]   blocks/moe/mlp/w_gate  [L, E, D, F]
    model.layers.i.block_sparse_moe.experts.e.w3.weight  [F, D]   blocks/moe/mlp/w_up    [L, E, D, F]
    model.layers.i.block_sparse_moe.experts.e.w2.weight  [D, F]   blocks/moe/mlp/w_down  [L, E, F, D]
  (the per-expert names of Mistral AI's published checkpoints, which transformers 5.x still writes, converting
  them to its fused experts when it loads)
  gemma2 (layer i is row i // 2 of the stacked pairs: blocks/local/... for even i, blocks/full/... for odd i):
    model.layers.i.input_layernorm.weight             [D]   blocks/{local,full}/attn_norm/scale       [L/2, D]
    model.layers.i.post_attention_layernorm.weight    [D]   blocks/{local,full}/attn_post_norm/scale  [L/2, D]
    model.layers.i.pre_feedforward_layernorm.weight   [D]   blocks/{local,full}/mlp_norm/scale        [L/2, D]
    model.layers.i.post_feedforward_layernorm.weight  [D]   blocks/{local,full}/mlp_post_norm/scale   [L/2, D]
    attention and MLP weights as Llama's beneath blocks/{local,full}/ (the norms' weights are Gemma's w of (1 + w),
    stored and loaded as they are)

Rotary convention: transformers rotates halves (`rotate_half`: element i pairs with i + K/2) in every family here,
and so does `jaxpar.model.layers.rotary`, so q/k rows load unpermuted (transformers' convert_llama_weights_to_hf.py
already permuted Meta's interleaved-pair weights into this layout).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import NamedTuple

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxpar.config.paths import write_atomic
from jaxpar.config.precision import DTYPE_BYTES
from jaxpar.config.schema import ModelConfig
from jaxpar.model.hf.config import HFConfigError

_LOGGER = logging.getLogger("jaxpar.model.hf")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED = re.compile(r"(model\.layers\.\d+\.self_attn\.|model\.)rotary_emb\.inv_freq")  # old exports' buffers


class _Entry(NamedTuple):
    """One per-layer Hugging Face tensor: model.layers.i.SUFFIX is jaxpar's blocks/PATH[i] (or, for an expert,
    blocks/PATH[i, EXPERT]), reshaped by KIND (`_to_jaxpar`); HF_SHAPE is its shape in the HF file."""

    suffix: str
    path: tuple[str, ...]
    kind: str
    hf_shape: tuple[int, ...]
    expert: int | None = None


def layer_slots(cfg: ModelConfig) -> list[tuple[int, int, tuple[str, ...]]]:
    """(HF layer i, its row of jaxpar's stacked blocks, the path prefix beneath blocks/) for every layer: (i, i, ())
    but for gemma2, whose stack rows are (local, full) pairs: (i, i // 2, ("local",) or ("full",))."""
    if cfg.name == "gemma2":
        return [(i, i // 2, ("local",) if i % 2 == 0 else ("full",)) for i in range(cfg.n_layers)]
    return [(i, i, ()) for i in range(cfg.n_layers)]


def _gemma2_entries(cfg: ModelConfig) -> list[_Entry]:
    """A Gemma 2 layer's tensors (paths beneath its pair member: `layer_slots`)."""
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_width, cfg.d_ff
    return [
        _Entry("input_layernorm.weight", ("attn_norm", "scale"), "vector", (d,)),
        _Entry("self_attn.q_proj.weight", ("attn", "wq"), "in_heads", (h * k, d)),
        _Entry("self_attn.k_proj.weight", ("attn", "wk"), "in_heads", (g * k, d)),
        _Entry("self_attn.v_proj.weight", ("attn", "wv"), "in_heads", (g * k, d)),
        _Entry("self_attn.o_proj.weight", ("attn", "wo"), "heads_out", (d, h * k)),
        _Entry("post_attention_layernorm.weight", ("attn_post_norm", "scale"), "vector", (d,)),
        _Entry("pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), "vector", (d,)),
        _Entry("mlp.gate_proj.weight", ("mlp", "w_gate"), "linear", (f, d)),
        _Entry("mlp.up_proj.weight", ("mlp", "w_up"), "linear", (f, d)),
        _Entry("mlp.down_proj.weight", ("mlp", "w_down"), "linear", (d, f)),
        _Entry("post_feedforward_layernorm.weight", ("mlp_post_norm", "scale"), "vector", (d,)),
    ]


def _layer_entries(cfg: ModelConfig) -> list[_Entry]:
    """The per-layer tensors of `cfg`'s family, in transformers' module order (module docstring); their paths
    beneath blocks/ and the layer's prefix (`layer_slots`)."""
    if cfg.name == "gemma2":
        return _gemma2_entries(cfg)
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_width, cfg.d_ff
    block: tuple[str, ...] = ("moe",) if cfg.moe.enabled else ()  # mixtral: blocks/moe/...
    attn = (*block, "attn")
    out = [
        _Entry("input_layernorm.weight", (*block, "attn_norm", "scale"), "vector", (d,)),
        _Entry("self_attn.q_proj.weight", (*attn, "wq"), "in_heads", (h * k, d)),
        _Entry("self_attn.k_proj.weight", (*attn, "wk"), "in_heads", (g * k, d)),
        _Entry("self_attn.v_proj.weight", (*attn, "wv"), "in_heads", (g * k, d)),
    ]
    if cfg.name == "qwen2":
        out += [
            _Entry("self_attn.q_proj.bias", (*attn, "bq"), "bias", (h * k,)),
            _Entry("self_attn.k_proj.bias", (*attn, "bk"), "bias", (g * k,)),
            _Entry("self_attn.v_proj.bias", (*attn, "bv"), "bias", (g * k,)),
        ]
    if cfg.name == "qwen3":
        out += [
            _Entry("self_attn.q_norm.weight", (*attn, "q_norm", "scale"), "vector", (k,)),
            _Entry("self_attn.k_norm.weight", (*attn, "k_norm", "scale"), "vector", (k,)),
        ]
    out += [
        _Entry("self_attn.o_proj.weight", (*attn, "wo"), "heads_out", (d, h * k)),
        _Entry("post_attention_layernorm.weight", (*block, "mlp_norm", "scale"), "vector", (d,)),
    ]
    if not cfg.moe.enabled:
        return out + [
            _Entry("mlp.gate_proj.weight", ("mlp", "w_gate"), "linear", (f, d)),
            _Entry("mlp.up_proj.weight", ("mlp", "w_up"), "linear", (f, d)),
            _Entry("mlp.down_proj.weight", ("mlp", "w_down"), "linear", (d, f)),
        ]
    mlp, f_e = (*block, "mlp"), cfg.moe.d_expert or f
    out.append(_Entry("block_sparse_moe.gate.weight", (*mlp, "router"), "linear", (cfg.moe.num_experts, d)))
    for e in range(cfg.moe.num_experts):
        prefix = f"block_sparse_moe.experts.{e}"
        out += [
            _Entry(f"{prefix}.w1.weight", (*mlp, "w_gate"), "linear", (f_e, d), e),
            _Entry(f"{prefix}.w2.weight", (*mlp, "w_down"), "linear", (d, f_e), e),
            _Entry(f"{prefix}.w3.weight", (*mlp, "w_up"), "linear", (f_e, d), e),
        ]
    return out


PARTIAL = ".partial"  # a safetensors file being written: renamed to its name once whole


@contextlib.contextmanager
def whole_file(path: str) -> Iterator[str]:
    """Yields PATH.partial to write a file into; renames it to `path` once the block ends, with the mode of any new
    file (0666 less the umask: safetensors makes it 0600, which other users of a shared cluster could not read),
    and removes it if the block raises: the file is whole or not there."""
    partial = path + PARTIAL
    try:
        yield partial
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise


def _save(tensors: dict[str, np.ndarray], path: str) -> None:
    """Writes a safetensors file whole or not at all (`whole_file`)."""
    with whole_file(path) as partial:
        save_file(tensors, partial, metadata={"format": "pt"})


def _open(path: str):
    """`safe_open(path)` for numpy arrays.

    Raises:
      HFConfigError: the file is not a whole safetensors file (truncated, damaged, or another format).
    """
    try:
        return safe_open(path, "numpy")
    except (SafetensorError, OSError) as e:
        raise HFConfigError(
            f"{path} is not a readable safetensors file ({e}): it is damaged or incomplete; copy or download it again"
        ) from None


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Hugging Face model of `cfg` holds -> its shape, in transformers' module order."""
    d, v = cfg.d_model, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    entries = _layer_entries(cfg)
    for i in range(cfg.n_layers):
        out.update({f"model.layers.{i}.{e.suffix}": e.hf_shape for e in entries})
    out["model.norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


def weight_files(hf_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file path: from model.safetensors.index.json when present, else from
    model.safetensors (reading only its header).

    Raises:
      HFConfigError: neither file exists, or the index names a missing file.
    """
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        missing = sorted({n for n in weight_map.values() if not os.path.isfile(os.path.join(hf_dir, n))})
        if missing:
            raise HFConfigError(f"{index} names files that are missing: {missing}")
        return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    single = os.path.join(hf_dir, SINGLE_FILE)
    if not os.path.isfile(single):
        raise HFConfigError(
            f"{hf_dir!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}; jaxpar reads safetensors weights only "
            f"(convert .bin / .pth files with transformers' save_pretrained(safe_serialization=True))"
        )
    with _open(single) as f:
        return {name: single for name in f.keys()}


def check_hf_tensors(hf_dir: str, cfg: ModelConfig) -> dict[str, str]:
    """Checks the directory's tensor names, shapes and dtypes against `cfg` reading only safetensors headers;
    returns weight_files(hf_dir).

    Raises:
      HFConfigError: a missing or unexpected tensor, a shape that differs from `cfg`'s, or a non-float dtype.
    """
    files = weight_files(hf_dir)
    want = hf_tensor_shapes(cfg)
    names = {n for n in files if not _IGNORED.fullmatch(n)}
    if cfg.tie_embeddings:
        names.discard("lm_head.weight")  # some tied exports also store the shared matrix; the embedding wins
    missing, extra = sorted(want.keys() - names), sorted(names - want.keys())
    if missing or extra:
        raise HFConfigError(
            f"{hf_dir}: tensors do not match a {cfg.name} model of config.json"
            + (f"; missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "")
            + (f"; unexpected: {extra[:5]}{' ...' if len(extra) > 5 else ''}" if extra else "")
        )
    by_file: dict[str, list[str]] = {}
    for name in want:
        by_file.setdefault(files[name], []).append(name)
    for path, file_names in by_file.items():
        with _open(path) as f:
            for name in file_names:
                view = f.get_slice(name)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                if shape != want[name]:
                    raise HFConfigError(f"{path}: {name} has shape {shape}, config.json implies {want[name]}")
                if dtype not in ("F32", "BF16", "F16"):
                    raise HFConfigError(f"{path}: {name} is {dtype}; jaxpar imports F32, BF16 and F16 weights")
    return files


def _to_jaxpar(w: np.ndarray, kind: str, cfg: ModelConfig) -> np.ndarray:
    d, k = cfg.d_model, cfg.head_width
    if kind == "vector":
        return w
    if kind == "linear":
        return w.T
    if kind == "bias":  # [heads*K] -> [heads, K]
        return w.reshape(-1, k)
    if kind == "in_heads":  # [heads*K, D] -> [D, heads, K]
        return w.T.reshape(d, -1, k)
    return w.T.reshape(-1, k, d)  # heads_out: [D, H*K] -> [H, K, D]


def _to_hf(w: np.ndarray, kind: str) -> np.ndarray:
    if kind == "vector":
        return w
    if kind == "linear":
        return w.T
    if kind == "bias":  # [heads, K] -> [heads*K]
        return w.reshape(-1)
    if kind == "in_heads":  # [D, heads, K] -> [heads*K, D]
        return w.reshape(w.shape[0], -1).T
    return w.reshape(-1, w.shape[-1]).T  # heads_out: [H, K, D] -> [D, H*K]


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def read_hf_params(hf_dir: str, cfg: ModelConfig) -> tuple[dict, str]:
    """Reads the weights of `hf_dir` into a jaxpar parameter dict of `cfg`'s family, float32 numpy arrays (the
    nested dict `jaxpar.model.init_params` returns), upcasting bf16/fp16 exactly. Returns (params, the stored dtype
    name: "float32", "bfloat16" or "float16"; the most common one if they are mixed).

    Raises:
      HFConfigError: as `check_hf_tensors`.
    """
    files = check_hf_tensors(hf_dir, cfg)
    want = hf_tensor_shapes(cfg)
    by_file: dict[str, list[str]] = {}
    for name in want:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, int] = {}  # stored dtype name -> tensors of it
    for path, names in by_file.items():
        with _open(path) as f:
            for name in names:
                w = f.get_tensor(name)
                dtypes[w.dtype.name] = dtypes.get(w.dtype.name, 0) + 1
                tensors[name] = w.astype(np.float32)
    layers: dict[tuple[str, ...], list] = {}  # jaxpar path -> per stack row: an array, or per expert a list
    for i, _, prefix in layer_slots(cfg):  # rows in order within each prefix
        for e in _layer_entries(cfg):
            w = _to_jaxpar(tensors.pop(f"model.layers.{i}.{e.suffix}"), e.kind, cfg)
            per_layer = layers.setdefault((*prefix, *e.path), [])
            if e.expert is None:
                per_layer.append(w)
            else:  # experts 0, 1, ... of layer i in order
                if e.expert == 0:
                    per_layer.append([])
                per_layer[-1].append(w)
    blocks: dict = {}
    for leaf, per_layer in layers.items():
        _set(blocks, leaf, np.stack([np.stack(x) if isinstance(x, list) else x for x in per_layer]))
    params = {
        "embed": {"table": tensors.pop("model.embed_tokens.weight")},
        "blocks": blocks,
        "final_norm": {"scale": tensors.pop("model.norm.weight")},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": tensors.pop("lm_head.weight").T}
    stored = max(dtypes, key=lambda name: dtypes[name])
    _LOGGER.info("read %d tensors (%s) from %s", len(want), ", ".join(sorted(dtypes)), hf_dir)
    return params, stored


def hf_tensors(params: dict, cfg: ModelConfig, dtype: str) -> dict[str, np.ndarray]:
    """The Hugging Face tensors (name -> contiguous numpy array of `dtype`, transformers' module order) of a
    jaxpar parameter dict of `cfg`'s family (numpy or jax arrays, any float dtype).

    Raises:
      HFConfigError: an unknown `dtype`, or a parameter shaped unlike `cfg`.
    """
    if dtype not in DTYPE_BYTES:
        raise HFConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)  # numpy has no bfloat16 of its own

    def cast(w) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(w, dtype=np.float32).astype(np_dtype))

    out = {"model.embed_tokens.weight": cast(params["embed"]["table"])}
    entries, slots = _layer_entries(cfg), layer_slots(cfg)
    paths = {(*prefix, *e.path) for _, _, prefix in slots for e in entries}
    try:
        arrays = {path: np.asarray(_get(params["blocks"], path)) for path in paths}
    except KeyError as missing:
        raise HFConfigError(
            f"the parameters lack blocks/.../{missing.args[0]}, which a {cfg.name} model of this config has"
        ) from None
    for i, row, prefix in slots:
        for entry in entries:
            layer = arrays[prefix + entry.path][row]
            w = layer if entry.expert is None else layer[entry.expert]
            out[f"model.layers.{i}.{entry.suffix}"] = cast(_to_hf(w, entry.kind))
    out["model.norm.weight"] = cast(params["final_norm"]["scale"])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = cast(np.asarray(params["lm_head"]["kernel"]).T)
    want = hf_tensor_shapes(cfg)
    for name, w in out.items():
        if w.shape != want[name]:
            raise HFConfigError(
                f"parameter for {name} has shape {w.shape}, a {cfg.name} model of this config needs {want[name]}"
            )
    return out


def write_hf_tensors(tensors: dict[str, np.ndarray], out_dir: str, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Writes `tensors` as model.safetensors, or, above `max_shard_bytes` per file, as
    model-0000i-of-0000n.safetensors shards (filled in order) with model.safetensors.index.json, as transformers'
    save_pretrained does (metadata {"format": "pt"}). Returns the file names written.
    """
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, w in tensors.items():
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    os.makedirs(out_dir, exist_ok=True)
    if len(shards) == 1:
        _save(shards[0], os.path.join(out_dir, SINGLE_FILE))
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        _save(shard, os.path.join(out_dir, file))
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(w.nbytes for w in tensors.values())}, "weight_map": weight_map}
    write_atomic(os.path.join(out_dir, INDEX_FILE), json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, INDEX_FILE]
