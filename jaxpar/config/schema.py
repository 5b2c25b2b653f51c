"""Typed configuration tree of a jaxpar run.

One frozen dataclass per section. Every field has a default, so a YAML file names only what it changes.
Loading and dotted overrides live in `jaxpar.config.load`, type checking in `jaxpar.config.decode`; checks that
need several fields (divisibility, mesh size against device count) live in `jaxpar.config.validate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# Blocks per unit of the layer stack for the built-in families whose blocks alternate (`ModelConfig.layers_per_unit`):
# gemma2 stacks a local and a global attention layer as one unit (`jaxpar.model.gemma`).
LAYERS_PER_UNIT = {"gemma2": 2}


STACK_ATTRIBUTE = "blocks"  # the model attribute, and parameter key, holding the layer stack (jaxpar.model.interface)
FIRST_DENSE = "first_dense_"  # attribute prefix of the dense blocks before the stack (MoEConfig.first_dense)


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs in the built-in `llama` decoder (`jaxpar.model.moe`). Off by default
    (`num_experts: 0`): the model is dense and computes exactly as without this section.

    Attributes:
      num_experts: routed experts E per MoE block; 0 = dense model (no MoE), else at least 2.
      top_k: experts each token is sent to (1 <= top_k <= num_experts). Gates (softmax gating) are the router's
        softmax probabilities of the chosen experts, renormalised to sum to 1 when top_k > 1 (Mixtral, DeepSeek-V3);
        with top_k = 1 the raw probability (Switch Transformer), so the router learns from the main loss.
      d_expert: hidden width of each expert's SwiGLU; 0 means model.d_ff.
      shared_experts: experts every token passes through besides the routed ones (DeepSeekMoE, Dai et al. 2024):
        one SwiGLU of width shared_experts * d_expert added to the routed output. 0 = none.
      every: every `every`-th block is MoE, the others dense: the layer stack's unit is a group of `every`
        blocks whose last one is MoE (1 = every block MoE). Must divide model.n_layers - first_dense; with a
        pipeline the units ((n_layers - first_dense) / every) must also divide into mesh.pipeline *
        pipeline.virtual_stages model chunks.
      first_dense: the model's first `first_dense` blocks are dense (a SwiGLU MLP of model.d_ff), the rest the
        MoE stack (DeepSeek-V3's first_k_dense_replace, 3; DeepSeekMoE, Dai et al. 2024, section 4.1). They run
        with the embedding, before the layer stack: on the first pipeline stage, recomputed in its backward
        like the embedding, their parameters beside the embedding's on every stage. 0 = none.
      routing: `dropless` (every assignment computed: tokens sorted by expert and a grouped matmul,
        `jax.lax.ragged_dot`) or `capacity` (each expert takes at most C = ceil(capacity_factor * T * top_k / E)
        assignments per sequence, GShard-style; the rest are dropped: their routed output is zero, the residual
        carries them).
      capacity_factor: the C above (capacity routing only), > 0.
      aux_loss_weight: weight of the load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4), summed
        over MoE blocks. Switch uses 1e-2. With sigmoid gating it is DeepSeek-V3's sequence-wise balance loss
        and this its alpha per block (1e-4; `jaxpar.training.moe_loss`).
      z_loss_weight: weight of the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5), summed over MoE blocks.
        ST-MoE uses 1e-3.
      expert_axes: expert parallelism: the mesh axes, among `data` and `fsdp`, the experts are split over (YAML
        list, e.g. [fsdp] or [data, fsdp]; () = every device holds every expert). Each device holds
        num_experts / ep whole experts (ep = the product of the axes' sizes, which must divide num_experts) and
        sends each assignment to its expert's device with an all-to-all (`jaxpar.model.moe`). The experts sit on
        axes that already split the batch, as in DeepSpeed-MoE (Rajbhandari et al. 2022, section 4.1) and
        DeepSeek-V3 (technical report, section 3.2): no fifth mesh axis, and dense layers keep their layout.
      gating: the router's gating function (`jaxpar.model.moe.route`): `softmax` (the gates above) or `sigmoid`
        (DeepSeek-V3, technical report arXiv 2412.19437, section 2.1.2, eq. 12-16): affinities s_i = sigmoid(u .
        e_i) in fp32, the top_k chosen on s_i + b_i (b: the per-expert balancing bias, `bias_update_rate`), gates
        s_i / sum of the chosen s_j (the bias not in them, normalised for every top_k). The load-balancing loss
        then uses s_i / sum over all experts of s_j (eq. 19); the z-loss has no meaning there (z_loss_weight must
        be 0).
      routed_scale: every gate multiplied by this (DeepSeek-V3's routed_scaling_factor, 2.5 in its released
        config.json); > 0, 1.0 = unscaled.
      bias_update_rate: gamma of DeepSeek-V3's auxiliary-loss-free load balancing (section 2.1.2; 0.001 for most
        of its training), sigmoid gating only: after each step every MoE block's bias b_i moves by gamma *
        sign(mean load - load_i) over the step's global batch (`jaxpar.training.router_bias`). >= 0; 0 keeps the
        bias where it is (zeros, or an imported model's).
      expert_groups: node-limited routing (DeepSeek-V3, section 2.1.2; config.json n_group 8): the E experts in
        this many groups of E / expert_groups consecutive experts, and each token chooses its top_k among the
        experts of its `group_top_k` best groups, a group scored by the sum of its two highest choice scores
        (s + b under sigmoid gating, p under softmax). 1 = off. Must divide num_experts. It limits which experts
        a token may choose; the dispatch still moves every assignment by all-to-all over the expert axes.
      group_top_k: the groups each token may route to (DeepSeek-V3: topk_group 4), 1 <= group_top_k <=
        expert_groups, with top_k <= group_top_k * num_experts / expert_groups; 0 = every group (off).
      receive_factor: dropless routing with expert_axes only: the rows R each device's experts can receive per
        MoE block, as a multiple of its own assignments A = b * T * top_k: R = ceil(receive_factor * A), at
        most ep * A. 0 (default) = ep * A, the worst case (every assignment routed to one device): truly
        dropless. Smaller saves the receive buffer and the experts' padded rows (DeepSeek-V3, ep = 64: the worst
        case is 64 * A rows); assignments past R at a device are dropped (their routed output is zero, the
        residual carries the token) and counted in the moe_dropped_fraction metric. >= 0.
      all_to_all: dropless routing's transport over expert_axes (`jaxpar.parallel.ragged`): `auto` (ragged on
        GPU and TPU, emulated elsewhere), `ragged` (`jax.lax.ragged_all_to_all`: each device sends only the rows
        it routes; GPU and TPU only, XLA:CPU has none) or `emulated` (a dense all-to-all of a buffer padded for
        the worst case, ep * min(A, R) rows; any backend). Both give the same result.
    """

    num_experts: int = 0
    top_k: int = 2
    d_expert: int = 0
    shared_experts: int = 0
    every: int = 1
    first_dense: int = 0
    routing: str = "dropless"
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    expert_axes: tuple[str, ...] = ()
    gating: str = "softmax"
    routed_scale: float = 1.0
    bias_update_rate: float = 0.0
    expert_groups: int = 1
    group_top_k: int = 0
    receive_factor: float = 0.0
    all_to_all: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer: which model family, and its shape. A family reads the fields it needs (the
    built-in `llama` reads them all; see the family's docstring).

    Attributes:
      name: the model family (`jaxpar.model.registry`): `llama` is built in; a script registers its own with
        `jaxpar.register_model` before loading a config that names it.
      vocab_size: rows of the embedding table; at least the tokenizer's vocabulary (259 for bytes).
      d_model: model width D.
      n_layers: transformer blocks L, stacked on a leading `layers` axis and run with a scan.
      n_heads: query heads H; D need not equal H * head_dim.
      n_kv_heads: key/value heads (grouped-query attention); null means n_heads. Must divide n_heads.
      head_dim: per-head width K; null means d_model // n_heads.
      d_ff: SwiGLU hidden width F.
      rope_theta: rotary embedding base (RoFormer, Su et al. 2021).
      rope_scaling: rotary frequency scaling for a longer context (`jaxpar.model.rope`): `none`, `linear`
        (every frequency / rope_scaling_factor) or `llama3` (Llama 3.1+: long wavelengths / factor, short ones
        kept, those between interpolated; Hugging Face's `rope_type: llama3`).
      rope_scaling_factor: the scaling's factor (Llama 3.2 1B: 32; Llama 3.1 8B: 8).
      rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position: llama3 scaling only: wavelengths
        above rope_original_max_position / rope_low_freq_factor are scaled, those below
        rope_original_max_position / rope_high_freq_factor kept (Llama 3.x: 1, 4, 8192).
      norm_eps: RMSNorm epsilon.
      tie_embeddings: share the embedding table with the output projection.
      init_std: standard deviation of the normal initialiser for weight matrices.
      remat: activation checkpointing per block: `none` (save every matmul output, recompute only elementwise
        ops and the fsdp weight all-gathers), `dots` (save only matmul outputs without batch dimensions:
        attention scores are recomputed too), `names` (save only the named attention context and MLP hidden
        activations) or `full` (save only the block input, recompute the block). With tensor parallelism every
        policy also saves the block exits' reduced outputs, and none and dots the sequence-parallel all-gathered
        inputs (`jaxpar.model.stack`).
      attention: the attention implementation (`jaxpar.config.attention`): `auto` (cuDNN's fused flash kernel on
        an NVIDIA GPU when the compute dtype is 16-bit and the head width allows, XLA otherwise), `xla` (writes the
        [b, H, T, T] scores to memory), or `cudnn` (NVIDIA GPUs, bfloat16/float16 only).
      max_segments: the most packed documents (runs of equal segment ids) one sequence may hold on the cuDNN
        path, whose packed layout has a fixed number of segment slots per row; a row with more gets a NaN
        output (and a skipped step). Unused by xla and by batches without segment ids.
      sliding_window: local causal attention (Mistral; Beltagy et al. 2020, "Longformer", section 3.1): each
        query sees itself and the `sliding_window` - 1 keys before it (within its document when packed), on every
        attention layer; null (default): all earlier keys. Both attention paths honour it (XLA's mask, cuDNN's
        sliding-window kernel); context parallelism refuses it (`jaxpar.config.validate`).
      kv_lora_rank: Multi-head Latent Attention (MLA; DeepSeek-V2, arXiv 2405.04434, section 2.1; DeepSeek-V3,
        arXiv 2412.19437, section 2.1.1; `jaxpar.model.mla`) when set: keys and values are up-projected per head from
        one compressed latent c_KV of this width per token (DeepSeek-V3: 512). null (default): the usual attention,
        and the four keys below are unused. MLA ignores n_kv_heads (every head has its own keys and values) and
        head_dim but as the widths' default.
      q_lora_rank: MLA's compressed query latent c_Q (DeepSeek-V3: 1536); null: the queries are projected from the
        block input directly (DeepSeek-V2-Lite).
      qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA's per-head widths of the queries' and keys' part without
        rotary embedding, of their rotary part (one rotary key shared by the heads) and of the values (DeepSeek-V3:
        128, 64, 128); null: the head width K, K / 2 and K. Scores are scaled by (qk_nope_head_dim +
        qk_rope_head_dim) ** -0.5 unless attention_scale_width is set.
      init_from: a local Hugging Face model directory (config.json + safetensors, `jaxpar.model.hf`) or a
        jaxpar run / checkpoint directory whose parameters a fresh run starts from (parameters only: a fresh
        optimizer at step 0; `jaxpar.training.init_from`). Its model (shapes, rope, norm epsilon, tying) must
        equal this config's, checked before any device work. "" (default): random initialisation from
        train.seed. A run that has its own checkpoints resumes from them instead.
      moe: mixture-of-experts blocks (`MoEConfig`); off by default.
    """

    name: str = "llama"
    vocab_size: int = 264
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int = 384
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    remat: str = "none"
    attention: str = "auto"
    max_segments: int = 64
    sliding_window: int | None = field(default=None, metadata={"example": 4096})
    attention_softcap: float | None = field(default=None, metadata={"example": 50.0})
    final_softcap: float | None = field(default=None, metadata={"example": 30.0})
    attention_scale_width: int | None = field(default=None, metadata={"example": 256})
    kv_lora_rank: int | None = field(default=None, metadata={"example": 512})
    q_lora_rank: int | None = field(default=None, metadata={"example": 1536})
    qk_nope_head_dim: int | None = field(default=None, metadata={"example": 128})
    qk_rope_head_dim: int | None = field(default=None, metadata={"example": 64})
    v_head_dim: int | None = field(default=None, metadata={"example": 128})
    init_from: str = ""
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def layers_per_unit(self) -> int:
        """Blocks in one unit of the stacked `blocks`: model.moe.every with `moe` (dense blocks, then an MoE one),
        2 for gemma2 (a local, then a global attention layer: `LAYERS_PER_UNIT`), else 1."""
        return self.moe.every if self.moe.enabled else LAYERS_PER_UNIT.get(self.name, 1)

    @property
    def first_dense(self) -> int:
        """The dense blocks before the layer stack (`MoEConfig.first_dense` with `moe`, else 0)."""
        return self.moe.first_dense if self.moe.enabled else 0

    @property
    def stacked_layers(self) -> int:
        """The blocks in the stacked `blocks`: n_layers less the `first_dense` blocks before it."""
        return self.n_layers - self.first_dense

    @property
    def stack_depth(self) -> int:
        """Units of the stacked `blocks`: stacked_layers / layers_per_unit."""
        return self.stacked_layers // self.layers_per_unit

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def mla(self) -> bool:
        """Multi-head Latent Attention instead of the usual attention (`kv_lora_rank` set)."""
        return self.kv_lora_rank is not None

    @property
    def mla_widths(self) -> tuple[int, int, int]:
        """MLA's (qk_nope_head_dim, qk_rope_head_dim, v_head_dim), their nulls resolved (K, K / 2, K)."""
        k = self.head_width
        nope, rope, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        return (k if nope is None else nope, k // 2 if rope is None else rope, k if v is None else v)

    @property
    def kernel_head_width(self) -> int:
        """The head width the attention kernel gets: `head_width`, or with MLA max(qk_nope_head_dim +
        qk_rope_head_dim, v_head_dim), q, k and v zero-padded to one width (`jaxpar.model.mla`)."""
        if not self.mla:
            return self.head_width
        nope, rope, v = self.mla_widths
        return max(nope + rope, v)


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the five mesh axes; at most one may be -1 (fills the remaining devices).

    Device order, outermost to innermost: data, pipeline, fsdp, context, tensor (see `jaxpar.config.mesh_axes`).
    `context` (default 1: off) splits each sequence over devices (`ContextConfig`).
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1


@dataclass(frozen=True)
class TensorConfig:
    """Tensor parallelism over the `tensor` mesh axis (Megatron-LM; see `jaxpar.parallel.tensor`).

    Attributes:
      sequence_parallel: shard activations between blocks over the sequence on `tensor` (all-gather before
        each column-parallel block, reduce-scatter after each row-parallel one; Korthikanti et al. 2022).
        null: on whenever mesh.tensor > 1.
    """

    sequence_parallel: bool | None = None


@dataclass(frozen=True)
class ContextConfig:
    """Context parallelism over the `context` mesh axis: each sequence split into `mesh.context` slices, one per
    device, attention exchanging keys and values between them (`jaxpar.parallel.context`).

    Attributes:
      strategy: how a device's queries reach the other slices' keys and values:
        `all_gather` (the Llama 3 scheme, Dubey et al. 2024, section 3.3.2): K and V (the key/value heads only)
          all-gathered over `context` before attention, then one attention call of the local queries against the
          whole sequence; its backward reduce-scatters dK and dV. Runs model.attention's kernel (cuDNN's on NVIDIA
          GPUs). Holds a whole sequence's K/V per layer.
        `ring` (Liu et al. 2023, arXiv 2310.01889): the K/V blocks passed around the ring of `context` devices by
          `ppermute`, the next block's permute issued before the current block's compute so that they overlap;
          the partial results combined by online softmax in fp32. Holds two blocks at a time; each sub-block a call
          of model.attention's kernel (cuDNN's on NVIDIA GPUs, XLA's einsums elsewhere). Not with the zero-bubble
          pipeline schedules.
      The sequence is laid out load-balanced for causal masking: cut into 2 * mesh.context chunks, device i holds
      chunks i and 2 * mesh.context - 1 - i, so data.seq_len must divide by 2 * mesh.context.
    """

    strategy: str = "all_gather"


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over the `pipeline` mesh axis (see `jaxpar.parallel.pipeline`).

    Attributes:
      schedule: `1f1b` (one forward, one backward per clock tick after warm-up; PipeDream-Flush, Narayanan et
        al. 2021), `gpipe` (all forwards, then all backwards; Huang et al. 2019), or a zero-bubble schedule
        with the backward split into an input-gradient pass B and a weight-gradient pass W that fills the
        bubble: `zb-h1` (Qi et al. 2023, arXiv 2401.10241, section 2.1: 1F1B's memory, about a third of its
        bubble; interleaved with virtual_stages > 1) or `zb-v` (the V of arXiv 2405.15362 sections 3-4: two
        chunks per device, so virtual_stages: 2, near-zero bubble at 1F1B's activation memory, twice its
        permutes). The zero-bubble schedules run a static table slot by slot, each device its own op
        (`jaxpar.parallel.pipeline_zb`), and keep B's boundary values per microbatch until its W
        (`jaxpar.parallel.split_backward`).
      microbatches: M, microbatches each device's batch (per accumulation step) is split into for the pipeline.
        With mesh.pipeline == 1 they simply add to gradient accumulation.
      recompute: 1F1B and the zero-bubble schedules: `true` keeps each in-flight microbatch's stage input and
        rebuilds the stage forward before its backward (one more forward: 4/3 of the blocks' FLOPs); `false` keeps
        the forward's residuals instead (no FLOPs repeated; hfu == mfu with model.remat=none). Either stash is a
        ring of 2p - 1 microbatches per stage (1F1B), flat in M: stage inputs, or the residuals `model.remat` keeps
        for the stage's layers (`jaxpar.parallel.pipeline_1f1b`). Default false, by measurement (2 simulated CPU
        devices, p = 2, m = 8, d_model 256, 4 layers, vocabulary 32,000, 16 x 128 tokens, benchmarks/pipeline.py):
        matmul FLOPs per device 1.037x data parallelism's without recompute against 1.147x with (the tick ratio is
        1.125), step time 1.17-1.19x against 1.16-1.23x over two runs (a draw on CPU, where memory traffic weighs as
        much as FLOPs; a compute-bound accelerator pays the FLOPs), temp memory 217 MB against 212 MB per device
        (the logits dominate); with a small head (d_model 64, p = 4) the residual ring doubles the temporaries (2.3
        MB against 1.1 MB). Set true when the 2p - 1 microbatches' residuals do not fit.
      virtual_stages: v, model chunks per device for interleaved 1F1B (Narayanan et al. 2021, section 2.2.2):
        the layers split into p*v chunks, chunk c on device c mod p, so each device holds v non-adjacent chunks.
        The bubble shrinks from (p - 1)/(M + p - 1) to (p - 1)/(v*M + p - 1); the price is v times the
        activation permutes and a stash of 2pv - 1 chunk-microbatches (about 2p stages' worth, against
        2p - 1), plus one permute of the stage's layers into chunk order and of their gradients back per step
        (`jaxpar.parallel.schedule`, `jaxpar.parallel.pipeline`). Needs schedule 1f1b or zb-h1, mesh.pipeline > 1,
        model.n_layers divisible by mesh.pipeline * v and M divisible by mesh.pipeline. 1 = plain 1F1B. zb-v
        needs exactly 2 (its V) and takes any M.
      stage_layers: layers of each model chunk in model order: mesh.pipeline entries, or mesh.pipeline *
        virtual_stages with virtual stages (chunk c runs on device c mod p, on the V with zb-v), each at least 0
        and summing to model.n_layers (with model.moe, each a multiple of model.moe.every; with
        model.moe.first_dense, summing to the layer stack's n_layers - first_dense, the first stage running the
        first dense blocks before its share). [] (the default): the
        even split. The first stage also runs the embedding and the last the head and loss; in a lockstep
        pipeline the busiest stage sets every tick's pace, so giving the last stage fewer layers speeds the step
        (Megatron-LM's first/last-stage layer counts do the same). Every schedule runs it; the parameters stay
        stored evenly over `pipeline` in model order (checkpoints do not depend on the split), with zero rows
        after the last layer when mesh.pipeline does not divide the stack, and one permute per step moves the
        layers that change stage (`jaxpar.parallel.layer_split`). Evaluation runs the even split of the stored
        rows (zero rows are the identity).
      balance_stages: `true` picks stage_layers itself: the whole-layer split that balances the model chunks'
        training FLOPs, the head's 6*D*V per token included (`jaxpar.parallel.layer_split.balanced_split`;
        `jaxpar-plan` prints it). Not together with stage_layers.
      vocab_parallel: `true` splits the head and loss over the stages by vocabulary (Yeung et al. 2024,
        "Balancing Pipeline Parallelism with Vocabulary Parallelism", arXiv 2411.05288): in each tick every
        stage computes the logits of its 1/p of the vocabulary for the last stage's output, the softmax
        normaliser is all-reduced over `pipeline`, and so is the head's input gradient, so the head's 6*D*V
        FLOPs per token fall on every stage alike instead of on the last one. Costs two all-reduces of the
        stage activation [b, T', D] over `pipeline` per microbatch. schedule 1f1b with virtual_stages 1 for now,
        a vocabulary-parallel loss (the default cross-entropy), and model.vocab_size / mesh.tensor divisible by
        mesh.pipeline. The parameters do not change: every stage already holds the head.
    """

    schedule: str = "1f1b"
    microbatches: int = 1
    recompute: bool = False
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] = ()
    balance_stages: bool = False
    vocab_parallel: bool = False


@dataclass(frozen=True)
class Fp8Config:
    """FP8 GEMMs in the attention projections, MLPs and experts (`jaxpar.parallel.fp8`).

    Attributes:
      enabled: run the GEMMs of the attention projections (q, k, v, o), of the dense MLPs and of the MoE experts
        (gate, up, down) in FP8 with the hybrid recipe: E4M3 activations and weights in the forward, E5M2 output
        gradients in the backward, fp32 accumulation (Micikevicius et al. 2022, arXiv 2209.05433). The
        embedding, the head and loss, the norms, the router and attention's score GEMMs keep
        `precision.compute_dtype`;
        parameters, gradients and optimizer state keep `precision.layout`. Needs FP8 tensor cores on a GPU
        (compute capability 8.9+: L4, L40S, H100, H200, B200); runs on CPU at reference speed (for tests);
        refused on A100 and TPU.
      scaling: how each tensor's scale is found: `current` (per tensor, from the amax of the tensor being
        quantised, max-reduced over the mesh axes that split it) or `delayed` (from the amaxes of the same tensor in
        earlier steps, kept in the train state's `fp8` history; Transformer Engine's `DelayedScaling`).
      amax_history: delayed scaling's window: the steps of amaxes each GEMM operand keeps, 1 to 4096.
      amax_compute: delayed scaling's reduction of the window to one amax: `max` (the largest in the window) or
        `most_recent` (the last step's).
      margin: the scales leave 2^margin of headroom below the format's largest value, 0 to 8 (0: none).
    """

    enabled: bool = False
    scaling: str = "current"
    amax_history: int = 1024
    amax_compute: str = "max"
    margin: int = 0


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric formats.

    Attributes:
      compute_dtype: dtype of matmuls and activations: `float32`, `bfloat16`, or `auto` (bfloat16 on GPU/TPU,
        float32 on CPU).
      layout: `fp32` keeps fp32 parameters and gradients (16 bytes/param with Adam); `16p` is the ZeRO paper's
        mixed-precision layout: bf16 working parameters and gradients, fp32 master parameters and Adam moments
        (2 + 2 + 12 = 16 bytes/param; Rajbhandari et al. 2019, section 3.1).
      reduce_dtype: dtype in which gradients are reduce-scattered and all-reduced (`float32` or `bfloat16`).
      fp8: FP8 GEMMs in the attention projections, MLPs and experts (`Fp8Config`; off by default).
    """

    compute_dtype: str = "auto"
    layout: str = "fp32"
    reduce_dtype: str = "float32"
    fp8: Fp8Config = field(default_factory=Fp8Config)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup then decay, global-norm clipping, and ZeRO partitioning over the `data` axis.

    Attributes:
      zero_stage: what is partitioned across `data`: 0 nothing (DDP), 1 optimizer state, 2 optimizer state and
        gradients, 3 parameters too. The `fsdp` axis always partitions all three.
      warmup_steps: W; update k <= W uses `learning_rate` * k / W (update 1 already moves the parameters).
      decay: learning-rate decay over the updates after warmup, from `learning_rate` at update W + 1:
        `cosine`, `linear` or `constant` (formula: `jaxpar.training.optimizer.learning_rate_schedule`).
      min_lr_ratio: the rate the decay reaches after the last update (`train.steps`), as a fraction of
        `learning_rate`.
      grad_clip_norm: clip by global L2 norm; 0 disables clipping.
      weight_decay: decoupled weight decay (AdamW's lambda; the update subtracts learning rate * lambda * w).
      weight_decay_exclude: fnmatch patterns over parameter names (the dotted path in the parameter tree, e.g.
        `embed.table`, `blocks.attn_norm.scale`; `*` matches dots too): a parameter matching any gets no weight
        decay. The default leaves out the built-in families' norm scales, Qwen2's q/k/v biases (`bq`, `bk`,
        `bv`) and the MoE balancing bias (`router_bias`, set by its own rule); add `embed.*` to spare the
        embeddings. Each pattern you set must match a parameter of the model (checked when the step is planned,
        before any device work; `jaxpar.training.optimizer`); the default's need not.
    """

    learning_rate: float = 3e-3
    warmup_steps: int = 20
    decay: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    weight_decay_exclude: tuple[str, ...] = ("*.scale", "*.bq", "*.bk", "*.bv", "*.router_bias")
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    zero_stage: int = 1


@dataclass(frozen=True)
class DataSourceConfig:
    """One weighted source of a data mixture (`data.sources`, `jaxpar.data.mixture`). A key left null takes the
    value of the same key of the `data` section, so what all sources share is said once.

    Attributes:
      name: the source's name in metrics (`val_loss/<name>`) and logs: letters, digits, `_`, `-`, `.`; unique.
      weight: its share of every global batch's rows, > 0; the weights are normalised to sum to 1.
      source, path, validation_path, text_field, token_dtype, validation_fraction, max_bytes: as in `data`.
    """

    name: str = field(default="", metadata={"example": "web"})  # required: the default is no name
    weight: float = 1.0
    source: str | None = None
    path: str | None = None
    validation_path: str | None = None
    text_field: str | None = None
    token_dtype: str | None = None
    validation_fraction: float | None = None
    max_bytes: int | None = None


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are packed.

    Attributes:
      source: `stdlib` (the running interpreter's standard-library .py files), `text` (a directory or glob of
        text files), `jsonl` (JSON lines with a text field), `tokens` (flat binary file of token ids), `shards`
        (a token shard set made by `jaxpar-data tokenize`, read and packed lazily, row by row: `jaxpar.data.stream`)
        or `synthetic` (ids below model.vocab_size generated from `seed`, nothing read: `jaxpar.data.synthetic`).
      path: directory, glob or file for `text`, `jsonl`, `tokens`; the shard set directory for `shards`; ignored
        for `stdlib`; refused for `synthetic`.
      validation_path: `shards` only: a second shard set to validate on (same tokenizer); empty holds out the
        last whole documents of `path` that make up `validation_fraction` of its tokens.
      text_field: JSONL key holding the text.
      token_dtype: `uint16` or `uint32` for `tokens`.
      seq_len: tokens per packed training sequence T.
      validation_fraction: share of files (of tokens for `tokens`; of tokens, in whole documents at the end of the
        set, for `shards`; of the rows for `synthetic`) held out for validation.
      max_bytes: stop reading text after this many bytes (0: no limit); keeps CPU runs quick.
      seed: shuffle seed; for `synthetic` also the seed the ids are generated from.
      document_masking: packed text documents stay apart: attention never crosses a document boundary, rotary
        positions restart at each document, and a document's first token is not predicted from the previous
        document (`jaxpar.data.pack`). A flat `tokens` file has no document index and is packed without it;
        `synthetic` rows then hold several documents each, else one.
      synthetic_branching: `synthetic` only (all such sources of a mixture): each id is followed by one of this
        many successors, uniformly, so a model that learns the chain reaches a loss of log(synthetic_branching)
        nats; 0: uniform independent ids (loss log(model.vocab_size)). Below model.vocab_size.
      sources: a mixture (`DataSourceConfig` entries, `jaxpar.data.mixture`): each global batch's rows are shared
        out among the sources by weight, and each source's validation split is scored separately; empty (default)
        trains on the single source above. With sources, seq_len, seed, document_masking and synthetic_branching
        apply to all, and the other keys above are the defaults of the entries' null keys.
    """

    source: str = "stdlib"
    path: str = ""
    validation_path: str = ""
    text_field: str = "text"
    token_dtype: str = "uint16"
    seq_len: int = 128
    validation_fraction: float = 0.05
    max_bytes: int = 0
    seed: int = 0
    document_masking: bool = True
    synthetic_branching: int = 4
    sources: tuple[DataSourceConfig, ...] = ()


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing.

    Attributes:
      every_steps: save every K steps (and at the last step); 0 disables checkpoints.
      keep: number of most recent checkpoints kept.
      async_save: write in a background thread while training continues.
      restore_from: a checkpoint step directory or manager directory to start from instead of RUN_DIR's latest.
    """

    every_steps: int = 100
    keep: int = 3
    async_save: bool = True
    restore_from: str = ""


@dataclass(frozen=True)
class MetricsConfig:
    """Where per-step metrics go besides RUN_DIR/metrics.jsonl (always written): `jaxpar.training.trackers`.

    Attributes:
      tensorboard: TensorBoard event files under RUN_DIR/tensorboard.
      wandb: Weights & Biases (the optional `wandb` extra).
      wandb_project: the W&B project.
      wandb_mode: "offline" (written under RUN_DIR/wandb with no network; `wandb sync` uploads it), "online",
        "disabled", or "" (wandb decides: its WANDB_MODE environment variable, else online).
    """

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "jaxpar"
    wandb_mode: str = "offline"


@dataclass(frozen=True)
class TrainConfig:
    """The loop.

    Attributes:
      run_dir: where config, metrics, TensorBoard events and checkpoints go.
      steps: optimizer steps.
      global_batch_size: sequences per optimizer step, over all devices.
      grad_accum_steps: microbatches each device's batch is split into (gradient accumulation).
      seed: parameter-initialisation seed.
      log_every: write metrics every N steps (and, without the progress bar, a log line).
      eval_every: validation loss at step 0, every N steps and at the end; 0: only at the end.
      eval_batches: how much of the validation split each evaluation scores, in file order, every sequence
        once (never cycled): 0 the whole split; B > 0 its first min(B * global_batch_size, all) sequences.
        The last global batch is padded with masked rows; metrics report the tokens covered (`val_tokens`).
      peak_flops_per_device: dense peak FLOP/s to use for MFU when the device is not in the table; 0: unknown.
      peak_fp8_flops_per_device: dense FP8 peak FLOP/s for `mfu_fp8_peak` (with `precision.fp8.enabled`) when the
        device is not in `jaxpar.model.flops.PEAK_FP8_FLOPS` (e.g. an L4 or L40S); 0: unknown.
      progress_bar: show a tqdm progress bar; false: a log line every log_every steps instead.
      sample_tokens: tokens to generate from the trained model at the end (0: none), decoded with the data's
        tokenizer; skipped, saying why, without one (a `tokens` file) or above
        `jaxpar.training.sample.MAX_SAMPLE_PARAMS` parameters (they are gathered onto every host).
      max_bad_steps: stop the run after this many consecutive updates skipped for a NaN or inf gradient. A run
        never ends diverged: a NaN or inf loss, gradients or parameters at the last step stop it too, with fewer.
      divergence_rollbacks: how many times a run that hits `max_bad_steps`, or ends diverged, restores its last
        good checkpoint and continues, skipping the batches since (PaLM, Chowdhery et al. 2022, section 5.1); 0:
        stop at once (jaxpar-train exits 1, naming the step the loss became non-finite).
      watchdog_s: seconds without progress (a step, a validation batch or a checkpoint save) after which every
        process exits with status 124, naming the processes that are missing (`jaxpar.training.watchdog`);
        0 disables it. Must exceed the slowest checkpoint save and validation batch.
    """

    run_dir: str = "runs/default"
    steps: int = 200
    global_batch_size: int = 16
    grad_accum_steps: int = 1
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    peak_flops_per_device: float = 0.0
    peak_fp8_flops_per_device: float = 0.0
    progress_bar: bool = True
    sample_tokens: int = 120
    max_bad_steps: int = 10
    divergence_rollbacks: int = 0
    watchdog_s: float = 900.0


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (`jaxpar.parallel.distributed`). Empty values fall back to the JAXPAR_* environment variables
    that `jaxpar-launch` sets, then to jax's own cluster detection (SLURM, ...).

    Attributes:
      coordinator_address: host:port of process 0's coordinator.
      num_processes: processes in the run (0: from the environment).
      process_id: this process's index (-1: from the environment).
      auto_detect: let jax detect a cluster environment when no address is given.
      initialization_timeout_s: seconds to wait for every process to join.
    """

    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    auto_detect: bool = True
    initialization_timeout_s: int = 300


@dataclass(frozen=True)
class Config:
    """The whole run. `base` is only meaningful in YAML (a file this one extends) and is resolved at load."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    tensor: TensorConfig = field(default_factory=TensorConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def replace(self, **sections) -> Config:
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict:
        """Nested plain dicts and lists (tuples of entries, such as `data.sources`, become lists), as YAML holds
        them."""
        return _plain(dataclasses.asdict(self))


def _plain(value):
    """`value` with every tuple turned into a list, recursively (`yaml.safe_dump` refuses tuples)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
