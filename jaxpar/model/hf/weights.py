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
  deepseek_v3 (any model with Multi-head Latent Attention, `jaxpar.model.mla`: P, R, U its nope, rope and value
  head widths, X, Z its query and key/value latents; layer i < first_dense is the unstacked module first_dense_i/,
  the others rows i - first_dense of blocks/moe/ (MoE) or blocks/ (a dense model); the norms as Llama's):
    model.layers.i.self_attn.q_a_proj.weight            [X, D]          .../attn/wq_a          [D, X]
    model.layers.i.self_attn.q_a_layernorm.weight       [X]             .../attn/q_norm/scale  [X]
    model.layers.i.self_attn.q_b_proj.weight            [H*(P+R), X]    .../attn/wq_b          [X, H, P+R]  (*)
    (or, q_lora_rank null, self_attn.q_proj.weight      [H*(P+R), D]    .../attn/wq            [D, H, P+R]  (*))
    model.layers.i.self_attn.kv_a_proj_with_mqa.weight  [Z+R, D]        .../attn/wkv_a         [D, Z+R]     (*)
    model.layers.i.self_attn.kv_a_layernorm.weight      [Z]             .../attn/kv_norm/scale [Z]
    model.layers.i.self_attn.kv_b_proj.weight           [H*(P+U), Z]    .../attn/wkv_b         [Z, H, P+U]
    model.layers.i.self_attn.o_proj.weight              [D, H*U]        .../attn/wo            [H, U, D]
    dense blocks: model.layers.i.mlp.{gate,up,down}_proj.weight as Llama's (width model.d_ff)
    MoE blocks (F: model.moe.d_expert, S: shared_experts):
    model.layers.i.mlp.gate.weight                      [E, D]          blocks/moe/mlp/router       [L', D, E]
    model.layers.i.mlp.gate.e_score_correction_bias     [E]             blocks/moe/mlp/router_bias  [L', E]
    model.layers.i.mlp.experts.e.gate_proj.weight       [F, D]          blocks/moe/mlp/w_gate       [L', E, D, F]
    model.layers.i.mlp.experts.e.up_proj.weight         [F, D]          blocks/moe/mlp/w_up         [L', E, D, F]
    model.layers.i.mlp.experts.e.down_proj.weight       [D, F]          blocks/moe/mlp/w_down       [L', E, F, D]
    model.layers.i.mlp.shared_experts.{gate,up}_proj.weight [S*F, D]    blocks/moe/mlp/shared/w_{gate,up} [L', D, S*F]
    model.layers.i.mlp.shared_experts.down_proj.weight  [D, S*F]        blocks/moe/mlp/shared/w_down [L', S*F, D]
  (the per-expert names of DeepSeek's published checkpoints, which transformers 5.x writes too; the layers of
  multi-token prediction that DeepSeek's release stores after the last, model.layers.L..., are not read)

Rotary convention: transformers rotates halves (`rotate_half`: element i pairs with i + K/2) in every family here,
and so does `jaxpar.model.layers.rotary`, so q/k rows load unpermuted (transformers' convert_llama_weights_to_hf.py
already permuted Meta's interleaved-pair weights into this layout). DeepSeek's weights pair adjacent elements
instead (element 2i with 2i + 1), which transformers' DeepseekV3 applies at run time when config.json's
rope_interleave is true (its default): the tensors marked (*) then load with the R rotary elements of each head
(the last R of P+R; of wkv_a, the last R columns) in the order 0, 2, 4, ..., R - 2, 1, 3, ..., R - 1 (jaxpar's
element i is the stored 2i, its i + R/2 the stored 2i + 1: `rotary_order`), and export the inverse, writing
rope_interleave true.
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
from jaxpar.config.schema import FIRST_DENSE, ModelConfig
from jaxpar.model.hf.config import HFConfigError, read_hf_config

_LOGGER = logging.getLogger("jaxpar.model.hf")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED = re.compile(r"(model\.layers\.\d+\.self_attn\.|model\.)rotary_emb\.inv_freq")  # old exports' buffers
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_FLOAT32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")  # `export_dtype`


class _Entry(NamedTuple):
    """One per-layer Hugging Face tensor: model.layers.i.SUFFIX is jaxpar's PREFIX/PATH[row] (or, for an expert,
    PREFIX/PATH[row, EXPERT]; without the row for an unstacked layer: `LayerPlace`), laid out by KIND
    (`_to_jaxpar`); HF_SHAPE is its shape in the HF file."""

    suffix: str
    path: tuple[str, ...]
    kind: str
    hf_shape: tuple[int, ...]
    expert: int | None = None


class LayerPlace(NamedTuple):
    """Where Hugging Face layer `layer` lives in jaxpar's parameters: its tensors `entries`, with paths beneath
    `prefix` (from the parameter tree's root, e.g. ("blocks",), ("blocks", "local"), ("first_dense_0",)), at row
    `row` of the stacked prefix, or None for an unstacked module (a dense block before the stack)."""

    layer: int
    prefix: tuple[str, ...]
    row: int | None
    entries: list[_Entry]


def layer_places(cfg: ModelConfig, rope_interleave: bool = True) -> list[LayerPlace]:
    """Every Hugging Face layer of a model of `cfg`, in order, and where it lives (module docstring): row i of
    blocks/ but for gemma2, whose stack rows are (local, full) pairs (row i // 2 of blocks/local or blocks/full), and
    a model with Multi-head Latent Attention (deepseek_v3), whose first model.moe.first_dense layers are the
    unstacked first_dense_i/ and the rest rows of the stack. `rope_interleave`: the MLA rotary columns are stored
    in DeepSeek's interleaved pairs (config.json's rope_interleave); unused without MLA."""
    if cfg.name == "gemma2":
        entries = _gemma2_entries(cfg)
        return [
            LayerPlace(i, ("blocks", "local" if i % 2 == 0 else "full"), i // 2, entries) for i in range(cfg.n_layers)
        ]
    if not cfg.mla:
        entries = _layer_entries(cfg)
        return [LayerPlace(i, ("blocks",), i, entries) for i in range(cfg.n_layers)]
    first = cfg.first_dense
    dense = _deepseek_entries(cfg, (), moe=False, rope_interleave=rope_interleave)
    stacked = _deepseek_entries(cfg, ("moe",), moe=True, rope_interleave=rope_interleave) if cfg.moe.enabled else dense
    return [LayerPlace(i, (f"{FIRST_DENSE}{i}",), None, dense) for i in range(first)] + [
        LayerPlace(i, ("blocks",), i - first, stacked) for i in range(first, cfg.n_layers)
    ]


def rotary_order(width: int) -> np.ndarray:
    """int [width]: jaxpar's rotary element j is DeepSeek's interleaved element rotary_order(width)[j]: 0, 2, ...,
    width - 2, then 1, 3, ..., width - 1 (pairs (2i, 2i + 1) become (i, i + width / 2), the rotate-half layout)."""
    return np.concatenate([np.arange(0, width, 2), np.arange(1, width, 2)])


def tensor_layout(kind: str, cfg: ModelConfig) -> tuple[str, int, np.ndarray | None]:
    """A per-tensor KIND as (the plain kind it is laid out as: vector, linear, bias, in_heads or heads_out; the head
    width K it splits heads by; the order of jaxpar's last axis in the stored one, or None for the identity).

    The MLA kinds: mla_q (wq_b, wq: in_heads of width P+R), mla_kv (wkv_b: in_heads of width P+U), mla_out (wo:
    heads_out of width U), and with the rotary columns stored interleaved mla_q_interleaved (as mla_q, each head's
    last R elements in `rotary_order`) and mla_kv_a_interleaved (wkv_a: linear, the last R columns in it)."""
    if not kind.startswith("mla_"):
        return kind, cfg.head_width, None
    nope, rope, value = cfg.mla_widths
    if kind == "mla_kv":
        return "in_heads", nope + value, None
    if kind == "mla_out":
        return "heads_out", value, None
    if kind == "mla_kv_a_interleaved":
        assert cfg.kv_lora_rank is not None
        return (
            "linear",
            cfg.head_width,
            np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + rotary_order(rope)]),
        )
    order = np.concatenate([np.arange(nope), nope + rotary_order(rope)]) if kind == "mla_q_interleaved" else None
    return "in_heads", nope + rope, order


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


def _deepseek_entries(cfg: ModelConfig, block: tuple[str, ...], moe: bool, rope_interleave: bool) -> list[_Entry]:
    """A DeepSeek-V3 layer's tensors (module docstring), dense or MoE, their paths beneath the layer's prefix and
    `block`."""
    d, h, f = cfg.d_model, cfg.n_heads, cfg.d_ff
    nope, rope, value = cfg.mla_widths
    z, x = cfg.kv_lora_rank, cfg.q_lora_rank
    assert z is not None
    attn = (*block, "attn")
    q_kind = "mla_q_interleaved" if rope_interleave else "mla_q"
    out = [_Entry("input_layernorm.weight", (*block, "attn_norm", "scale"), "vector", (d,))]
    if x is None:
        out.append(_Entry("self_attn.q_proj.weight", (*attn, "wq"), q_kind, (h * (nope + rope), d)))
    else:
        out += [
            _Entry("self_attn.q_a_proj.weight", (*attn, "wq_a"), "linear", (x, d)),
            _Entry("self_attn.q_a_layernorm.weight", (*attn, "q_norm", "scale"), "vector", (x,)),
            _Entry("self_attn.q_b_proj.weight", (*attn, "wq_b"), q_kind, (h * (nope + rope), x)),
        ]
    kv_a_kind = "mla_kv_a_interleaved" if rope_interleave else "linear"
    out += [
        _Entry("self_attn.kv_a_proj_with_mqa.weight", (*attn, "wkv_a"), kv_a_kind, (z + rope, d)),
        _Entry("self_attn.kv_a_layernorm.weight", (*attn, "kv_norm", "scale"), "vector", (z,)),
        _Entry("self_attn.kv_b_proj.weight", (*attn, "wkv_b"), "mla_kv", (h * (nope + value), z)),
        _Entry("self_attn.o_proj.weight", (*attn, "wo"), "mla_out", (d, h * value)),
        _Entry("post_attention_layernorm.weight", (*block, "mlp_norm", "scale"), "vector", (d,)),
    ]
    mlp = (*block, "mlp")
    if not moe:
        return out + [
            _Entry("mlp.gate_proj.weight", (*mlp, "w_gate"), "linear", (f, d)),
            _Entry("mlp.up_proj.weight", (*mlp, "w_up"), "linear", (f, d)),
            _Entry("mlp.down_proj.weight", (*mlp, "w_down"), "linear", (d, f)),
        ]
    e, f_e, shared = cfg.moe.num_experts, cfg.moe.d_expert or f, cfg.moe.shared_experts * (cfg.moe.d_expert or f)
    out += [
        _Entry("mlp.gate.weight", (*mlp, "router"), "linear", (e, d)),
        _Entry("mlp.gate.e_score_correction_bias", (*mlp, "router_bias"), "vector", (e,)),
    ]
    for i in range(e):
        out += [
            _Entry(f"mlp.experts.{i}.gate_proj.weight", (*mlp, "w_gate"), "linear", (f_e, d), i),
            _Entry(f"mlp.experts.{i}.up_proj.weight", (*mlp, "w_up"), "linear", (f_e, d), i),
            _Entry(f"mlp.experts.{i}.down_proj.weight", (*mlp, "w_down"), "linear", (d, f_e), i),
        ]
    return out + [
        _Entry("mlp.shared_experts.gate_proj.weight", (*mlp, "shared", "w_gate"), "linear", (shared, d)),
        _Entry("mlp.shared_experts.up_proj.weight", (*mlp, "shared", "w_up"), "linear", (shared, d)),
        _Entry("mlp.shared_experts.down_proj.weight", (*mlp, "shared", "w_down"), "linear", (d, shared)),
    ]


def _layer_entries(cfg: ModelConfig) -> list[_Entry]:
    """The per-layer tensors of a Llama-layout family (llama, qwen2, qwen3, mistral, mixtral), in transformers'
    module order (module docstring); their paths beneath blocks/ (`layer_places`)."""
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
    for place in layer_places(cfg):
        out.update({f"model.layers.{place.layer}.{e.suffix}": e.hf_shape for e in place.entries})
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


def _after_last_layer(names: set[str], n_layers: int) -> set[str]:
    """The names of `names` in layers model.layers.L and on (L = `n_layers`): DeepSeek's multi-token prediction."""
    out = set()
    for name in names:
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= n_layers:
            out.add(name)
    return out


def check_hf_tensors(hf_dir: str, cfg: ModelConfig) -> dict[str, str]:
    """Checks the directory's tensor names, shapes and dtypes against `cfg` reading only safetensors headers;
    returns weight_files(hf_dir). With MLA (deepseek_v3) the layers after the last (the multi-token prediction of
    DeepSeek's release, which transformers' DeepseekV3ForCausalLM does not load either) are skipped.

    Raises:
      HFConfigError: a missing or unexpected tensor, a shape that differs from `cfg`'s, or a non-float dtype.
    """
    files = weight_files(hf_dir)
    want = hf_tensor_shapes(cfg)
    names = {n for n in files if not _IGNORED.fullmatch(n)}
    if cfg.tie_embeddings:
        names.discard("lm_head.weight")  # some tied exports also store the shared matrix; the embedding wins
    if cfg.mla:
        mtp = _after_last_layer(names, cfg.n_layers)
        if mtp:
            _LOGGER.info(
                "%s: %d tensors of multi-token prediction layers (model.layers.%d and on) not read",
                hf_dir,
                len(mtp),
                cfg.n_layers,
            )
        names -= mtp
        scales = sorted(n for n in names - want.keys() if n.endswith("_scale_inv"))
        if scales:
            raise HFConfigError(
                f"{hf_dir}: {scales[0]} and {len(scales) - 1} more: fp8 block-quantised weights (DeepSeek's release); "
                f"jaxpar imports F32, BF16 and F16 weights: dequantise them to bfloat16 first"
            )
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
    """One layer's HF tensor -> jaxpar's layout of `kind` (`tensor_layout`)."""
    kind, k, order = tensor_layout(kind, cfg)
    if kind == "vector":
        out = w
    elif kind == "linear":
        out = w.T
    elif kind == "bias":  # [heads*K] -> [heads, K]
        out = w.reshape(-1, k)
    elif kind == "in_heads":  # [heads*K, D] -> [D, heads, K]
        out = w.T.reshape(w.shape[1], -1, k)
    else:  # heads_out: [D, H*K] -> [H, K, D]
        out = w.T.reshape(-1, k, w.shape[0])
    return out if order is None else out[..., order]


def _to_hf(w: np.ndarray, kind: str, cfg: ModelConfig | None = None) -> np.ndarray:
    """One layer's jaxpar parameter of `kind` -> the HF tensor (`tensor_layout`; `cfg` is needed for the mla_*
    kinds only)."""
    if kind.startswith("mla_"):
        assert cfg is not None, f"the {kind} layout needs the model config"
        kind, _, order = tensor_layout(kind, cfg)
        if order is not None:
            w = w[..., np.argsort(order)]
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


def stored_rope_interleave(hf_dir: str, cfg: ModelConfig) -> bool:
    """Whether `hf_dir` stores the rotary columns of its MLA model `cfg` in DeepSeek's interleaved pairs (module
    docstring): config.json's rope_interleave, true where it leaves the key out (transformers' DeepseekV3 default).
    False without MLA.

    Raises:
      HFConfigError: no readable config.json (`jaxpar.model.hf.config.read_hf_config`).
    """
    return cfg.mla and bool(read_hf_config(hf_dir).get("rope_interleave", True))


def read_hf_params(hf_dir: str, cfg: ModelConfig) -> tuple[dict, str]:
    """Reads the weights of `hf_dir` into a jaxpar parameter dict of `cfg`'s family, float32 numpy arrays (the
    nested dict `jaxpar.model.init_params` returns), upcasting bf16/fp16 exactly; MLA rotary columns stored
    interleaved are reordered (`stored_rope_interleave`). Returns (params, the stored dtype name: "float32",
    "bfloat16" or "float16"; the most common one if they are mixed).

    Raises:
      HFConfigError: as `check_hf_tensors`.
    """
    files = check_hf_tensors(hf_dir, cfg)
    interleaved = stored_rope_interleave(hf_dir, cfg)
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
    # jaxpar path -> per layer (a stack row, or the one unstacked module) in order: an array, or per expert a list
    layers: dict[tuple[str, ...], list] = {}
    stacked: dict[tuple[str, ...], bool] = {}
    for place in layer_places(cfg, interleaved):  # rows in order within each prefix
        for e in place.entries:
            w = _to_jaxpar(tensors.pop(f"model.layers.{place.layer}.{e.suffix}"), e.kind, cfg)
            leaf = (*place.prefix, *e.path)
            per_layer = layers.setdefault(leaf, [])
            stacked[leaf] = place.row is not None
            if e.expert is None:
                per_layer.append(w)
            else:  # experts 0, 1, ... of layer i in order
                if e.expert == 0:
                    per_layer.append([])
                per_layer[-1].append(w)
    params = {
        "embed": {"table": tensors.pop("model.embed_tokens.weight")},
        "final_norm": {"scale": tensors.pop("model.norm.weight")},
    }
    for leaf, per_layer in layers.items():
        whole = [np.stack(x) if isinstance(x, list) else x for x in per_layer]
        _set(params, leaf, np.stack(whole) if stacked[leaf] else whole[0])
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": tensors.pop("lm_head.weight").T}
    stored = max(dtypes, key=lambda name: dtypes[name])
    _LOGGER.info("read %d tensors (%s) from %s", len(want), ", ".join(sorted(dtypes)), hf_dir)
    return params, stored


def export_dtype(name: str, cfg: ModelConfig, dtype: str) -> str:
    """The dtype an export of a model of `cfg` in `dtype` writes tensor `name` in: float32 for DeepseekV3's router
    weight and balancing bias (mlp.gate.weight, mlp.gate.e_score_correction_bias), which transformers keeps in
    float32 whatever the model's dtype (its `_keep_in_fp32_modules_strict`) and writes so: bf16 would move the
    bias by more than a step of DeepSeek's bias update (1e-3); else `dtype`."""
    return "float32" if cfg.mla and name.endswith(_FLOAT32_SUFFIXES) else dtype


def hf_tensors(params: dict, cfg: ModelConfig, dtype: str) -> dict[str, np.ndarray]:
    """The Hugging Face tensors (name -> contiguous numpy array of `dtype`, or float32 where `export_dtype` says
    so; transformers' module order) of a jaxpar parameter dict of `cfg`'s family (numpy or jax arrays, any float
    dtype).

    Raises:
      HFConfigError: an unknown `dtype`, or a parameter shaped unlike `cfg`.
    """
    if dtype not in DTYPE_BYTES:
        raise HFConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)  # numpy has no bfloat16 of its own

    def cast(w, name: str = "") -> np.ndarray:
        to = np.float32 if export_dtype(name, cfg, dtype) == "float32" else np_dtype
        return np.ascontiguousarray(np.asarray(w, dtype=np.float32).astype(to))

    out = {"model.embed_tokens.weight": cast(params["embed"]["table"])}
    places = layer_places(cfg)
    paths = {(*place.prefix, *e.path) for place in places for e in place.entries}
    try:
        arrays = {path: np.asarray(_get(params, path)) for path in paths}
    except KeyError as missing:
        raise HFConfigError(
            f"the parameters lack .../{missing.args[0]}, which a {cfg.name} model of this config has"
        ) from None
    for place in places:
        for entry in place.entries:
            layer = arrays[place.prefix + entry.path]
            layer = layer if place.row is None else layer[place.row]
            w = layer if entry.expert is None else layer[entry.expert]
            name = f"model.layers.{place.layer}.{entry.suffix}"
            out[name] = cast(_to_hf(w, entry.kind, cfg), name)
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
