"""Expert parallelism in the plan (`model.moe.expert_axes`, ep = the product of those mesh axes' sizes): the MoE
dispatch and combine all-to-alls that `jaxpar.analysis.planner.comm` counts, and the plan's MoE summary. Letters as
in `jaxpar.analysis.planner.plan`; E experts, k top_k, C capacity per expert and sequence, T = r
(s/c: the tokens of each sequence on one device, s without context parallelism).

All-to-all (GShard, Lepikhin et al. 2020, arXiv 2006.16668, sections 2.2 and 3.2: dispatch and combine as
all-to-all over the expert-parallel devices; DeepSpeed-MoE, Rajbhandari et al. 2022, arXiv 2201.05596, section
5): every MoE block runs two all-to-alls over the expert axes in its forward (dispatch, combine) and two in its
backward (their transposes); under the remat policy `names` the backward's recomputation repeats the dispatch, under
`full` the dispatch and the combine (`none` and `dots` keep both outputs; `jaxpar.model.stack`; checked against
the compiled HLO in tests/unit/test_expert_bytes.py). Per all-to-all each
device holds a buffer of `size` elements in the compute dtype and sends (ep-1)/ep of it (`jaxpar.analysis.hlo.ring`):
  capacity routing   size = E*C*b*D, C = ceil(capacity_factor*T*k/E) per sequence (`jaxpar.parallel.expert.capacity`)
  dropless routing   ragged transport (`model.moe.all_to_all` ragged, or auto on gpu and tpu): a ragged
                     all-to-all whose send operand is the A = b*T*k local assignments, size = A*D, of which
                     (ep-1)/ep leaves the device with balanced routing and at most all of it (`worst_case`); the
                     receive buffer holds R rows (`jaxpar.parallel.expert.receive_rows`: ep*A, or
                     ceil(receive_factor*A)). Emulated transport (auto on cpu): a dense all-to-all of a buffer
                     padded for the worst case, size = ep*min(A, R)*D
The routed experts' weights need no reduction over the expert axes: the all-to-all's transpose brings every
token's contribution to the device that holds the expert.
"""

from __future__ import annotations

from jaxpar.config.choices import REMAT_KEEPING_EXITS_ONLY, REMAT_RECOMPUTING_EXPERTS
from jaxpar.config.mesh_axes import TENSOR
from jaxpar.config.moe import resolve_all_to_all
from jaxpar.config.schema import Config
from jaxpar.parallel.expert import all_to_all_buffer, all_to_alls_per_block, capacity, receive_rows

# The working set of one MoE block's backward at its peak, in elements of the compute dtype per row its experts run
# (`expert_rows`): HIDDEN_BUFFERS buffers of the experts' hidden width F/t (the recomputed gate and up projections,
# the hidden activation and their gradients, as many as are live at once) and ROW_BUFFERS of the model width D (the
# rows received, their gradient, the partial input gradient), plus, where the all-to-all is not ragged, its send and
# receive buffers. Read from the GPU compiler's buffer assignment at the step's peak (deviceless H100 compile of
# configs/mixtral_8x7b.yaml, R = 131072 rows: 4 bf16 [R, 14336] and 3 bf16 [R, 4096] on the ragged transport; 5
# [R, 4096] with the padded dense all-to-all, its two buffers [8, 16384, 4096] the same size).
# With several experts per device (El = E/ep > 1) on the dropless path, XLA's GPU lowering of the backward of
# `jax.lax.ragged_dot` expands its rows once per local expert, masked: 4 [El, R, F] and 2 [El, R, D] more (the
# deviceless compile of configs/deepseek_v3.yaml with dropless routing, El = 4, R = 65536: bf16 [4, 65536, 2048] and
# [4, 65536, 7168] at the peak). A waste a grouped GEMM that does not expand would remove; counted until then.
HIDDEN_BUFFERS = 4
ROW_BUFFERS = 3
EXPANDED_ROW_BUFFERS = 2


def is_ragged(cfg: Config, d) -> bool:
    """Whether the step's dispatch and combine are ragged all-to-alls: dropless routing with expert axes, whose
    `model.moe.all_to_all` resolves to `ragged` on the plan's platform (`jaxpar.config.moe.resolve_all_to_all`)."""
    moe = cfg.model.moe
    if not (moe.enabled and d.expert_axes and moe.routing == "dropless"):
        return False
    return resolve_all_to_all(moe.all_to_all, d.platform) == "ragged"


def assignments(cfg: Config, d) -> int:
    """A = b*T*k, one device's assignments (token, choice) of one microbatch in one MoE block."""
    return d.b * d.r * cfg.model.moe.top_k


def all_to_all_elements(cfg: Config, d) -> int:
    """The size of one MoE all-to-all on one device, in elements of the compute dtype (module docstring): capacity
    routing E*C*b*D; dropless A*D on the ragged transport (its send operand), ep*min(A, R)*D emulated (padded for
    the worst case; `jaxpar.parallel.expert.all_to_all_buffer` at R >= A). 0 without expert axes. `d`:
    `jaxpar.analysis.planner.dims.dims(cfg, platform)`."""
    moe, dm = cfg.model.moe, cfg.model.d_model
    if not d.expert_axes:
        return 0
    if moe.routing == "capacity":
        return all_to_all_buffer(moe.routing, d.ep, d.b, d.r, moe.top_k, moe.num_experts, dm, moe.capacity_factor)
    a = assignments(cfg, d)
    if is_ragged(cfg, d):
        return a * dm
    return d.ep * min(a, receive_rows(d.ep, a, moe.receive_factor)) * dm


def offset_all_to_alls(cfg: Config, d, passes: dict) -> tuple[int, int]:
    """(count, int32 elements per device) of the small all-to-alls that tell a dropless dispatch where its rows go
    (`jaxpar.parallel.expert.ExpertParallel.dispatch_dropless`), per step: each run of the dispatch (the forward's,
    a 1F1B recompute's, and the backward's re-run under remat names or full) sends the counts and start rows,
    ep*(E/ep + 1), and gets back where they land and how many fit, 2*ep; the ragged all-to-all's transpose (jax's
    rule) exchanges its input and output offsets, 2 of ep each, for each of the 2 ragged all-to-alls of a
    backward pass; the emulated transport sends its ep output offsets with each of its all-to-alls. (0, 0) without
    dropless expert parallelism."""
    moe = cfg.model.moe
    if not (moe.enabled and d.expert_axes and moe.routing == "dropless"):
        return 0, 0
    blocks = passes["layers"] // moe.every
    n, el = d.ep, moe.num_experts // d.ep
    per_block = all_to_alls_per_block(cfg.model.remat)
    runs = blocks * (passes["fwd"] + passes["bwd"] * (per_block[1] - 1))
    count, elements = 2 * runs, runs * (n * (el + 1) + 2 * n)
    if is_ragged(cfg, d):
        extra = blocks * passes["bwd"] * 2 * 2  # the backward's 2 transposed ragged all-to-alls, 2 each
    else:
        extra = blocks * (2 * passes["fwd"] + passes["bwd"] * (per_block[0] - 4))  # each emulated one run forward
    return count + extra, elements + extra * n


def all_to_all_count(cfg: Config, d, passes: dict) -> int:
    """Buffer all-to-alls per step on one device (module docstring): per MoE block 2 in each forward pass (a 1F1B
    recompute's included), 2 in each backward pass, and 1 or 2 more per backward pass under a remat policy whose
    backward re-runs the dispatch, or the dispatch and the combine (`jaxpar.parallel.expert.all_to_alls_per_block`);
    L/every MoE blocks of the L layers of a pass. (Dropless routing's int32 expert counts, E * 4 bytes per
    dispatch, are left out.)"""
    per_pass = passes["layers"] // cfg.model.moe.every
    rerun = passes["bwd"] * (all_to_alls_per_block(cfg.model.remat)[0] - 4)
    return per_pass * (2 * passes["fwd"] + 2 * passes["bwd"] + rerun)


def expert_summary(cfg: Config, d, state: dict, terms: list) -> dict | None:
    """The MoE part of a plan (`jaxpar.analysis.planner.plan.plan`'s "experts"): None for a dense model, else
    {"num_experts" E, "top_k", "routing", "axes" (the expert axes), "ep", "experts_per_device" (E/ep),
    "expert_params_per_rank" (P_e after the 1/ep split), "all_to_all_bytes" (sent per device per step: the
    all-to-all rows of `terms`, the step's `jaxpar.analysis.planner.comm.CollectiveTerm`s; the ragged ones at
    balanced routing), "all_to_all_worst_bytes" (the same when every row a device holds goes to another device:
    the ragged rows' whole send operands; equal for padded buffers), "all_to_all_count", "transport" (`ragged`,
    `emulated` or `capacity`), "receive_buffer_bytes" (one dispatch's receive buffer as sized: R*D for dropless,
    `jaxpar.parallel.expert.receive_rows`, the capacity buffer E*C*b*D; compute dtype)}.
    `d`: `jaxpar.analysis.planner.dims.dims`; `state`: `jaxpar.analysis.planner.plan.state_bytes`."""
    moe = cfg.model.moe
    if not moe.enabled:
        return None
    a2a = [t for t in terms if t.kind in ("all-to-all", "ragged-all-to-all")]
    ragged = sum(t.bytes for t in a2a if t.kind == "ragged-all-to-all")
    if moe.routing == "capacity" or not d.expert_axes:
        receive = all_to_all_elements(cfg, d)
    else:
        receive = receive_rows(d.ep, assignments(cfg, d), moe.receive_factor) * cfg.model.d_model
    return {
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "routing": moe.routing,
        "axes": list(d.expert_axes),
        "ep": d.ep,
        "experts_per_device": moe.num_experts // d.ep,
        "expert_params_per_rank": state["n_expert_params"],
        "all_to_all_bytes": sum(t.bytes for t in a2a),
        "all_to_all_worst_bytes": sum(t.bytes for t in a2a) + (ragged / (d.ep - 1) if ragged else 0.0),
        "all_to_all_count": sum(t.count for t in a2a),
        "transport": "capacity" if moe.routing == "capacity" else ("ragged" if is_ragged(cfg, d) else "emulated"),
        "receive_buffer_bytes": receive * d.compute_bytes,
    }


def expert_rows(cfg: Config, d) -> int:
    """R, the rows one device's routed experts run per MoE block and microbatch: every assignment its experts
    receive, padding included. Capacity routing: E*C*b (each local expert's C slots from each of the ep sources);
    dropless: A = b*r*k local assignments without expert parallelism, else the rows of the receive buffer
    (`jaxpar.parallel.expert.receive_rows`, on either transport). 0 for a dense model. `d`:
    `jaxpar.analysis.planner.dims.dims`."""
    moe = cfg.model.moe
    if not moe.enabled:
        return 0
    if moe.routing == "capacity":
        return capacity_rows(cfg, d)
    if d.expert_axes:
        return receive_rows(d.ep, assignments(cfg, d), moe.receive_factor)
    return assignments(cfg, d)


def capacity_rows(cfg: Config, d) -> int:
    """E*C*b, the rows of capacity routing's buffer on one device (C = `jaxpar.parallel.expert.capacity` per
    sequence): what the combine returns, and with expert parallelism what the local experts receive."""
    moe = cfg.model.moe
    return moe.num_experts * capacity(d.r, moe.top_k, moe.num_experts, moe.capacity_factor) * d.b


def working_bytes(cfg: Config, d) -> int:
    """Bytes one MoE block's backward holds at its peak on one device (module constants HIDDEN_BUFFERS and
    ROW_BUFFERS, measured): (HIDDEN_BUFFERS * R * F/t + ROW_BUFFERS * R * D + 2 S) * Bc with R = `expert_rows`, F
    the experts' hidden width and S the all-to-all's buffer (`all_to_all_elements`; 0 on the ragged transport);
    dropless with El = E/ep > 1 local experts, El * HIDDEN_BUFFERS and ROW_BUFFERS + El * EXPANDED_ROW_BUFFERS
    (the grouped matmul's backward expanded per expert). 0 for a dense model. Like the attention's working set it
    is one layer's, at one moment."""
    moe, mdl = cfg.model.moe, cfg.model
    rows = expert_rows(cfg, d)
    f_t = (moe.d_expert or mdl.d_ff) // d.shape[TENSOR]
    dense = 0 if is_ragged(cfg, d) else 2 * all_to_all_elements(cfg, d)  # a padded all-to-all's two buffers
    hidden, model_width = HIDDEN_BUFFERS, ROW_BUFFERS
    local = moe.num_experts // d.ep
    if moe.routing == "dropless" and local > 1:  # ragged_dot's backward expanded per local expert
        hidden, model_width = HIDDEN_BUFFERS * local, ROW_BUFFERS + EXPANDED_ROW_BUFFERS * local
    return (hidden * rows * f_t + model_width * rows * mdl.d_model + dense) * d.compute_bytes


def saved_bytes(cfg: Config, d) -> int:
    """Bytes one MoE block keeps for its backward per microbatch beyond its block input, by `model.remat`
    (`jaxpar.model.stack`): the all-to-all outputs its policy saves, in the compute dtype. full saves neither
    (`REMAT_RECOMPUTING_EXPERTS`); names the combine's output; none and dots the dispatch's too. The combine's output is
    the capacity buffer E*C*b*D (capacity routing) or the assignments' outputs A*D (dropless, A = b*r*k); the
    dispatch's the received rows R*D (`expert_rows`). 0 without expert axes (nothing crosses devices; the experts'
    own saved matmul outputs are the policy's, counted with the block's) or for a dense model."""
    moe, mdl = cfg.model.moe, cfg.model
    if not (moe.enabled and d.expert_axes) or mdl.remat in REMAT_RECOMPUTING_EXPERTS:
        return 0
    combined = capacity_rows(cfg, d) if moe.routing == "capacity" else assignments(cfg, d)
    dispatched = 0 if mdl.remat in REMAT_KEEPING_EXITS_ONLY else expert_rows(cfg, d)
    return (combined + dispatched) * mdl.d_model * d.compute_bytes
