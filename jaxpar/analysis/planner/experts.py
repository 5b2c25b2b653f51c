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
  dropless routing   size = ep*A*D, A = b*T*k local assignments: without a ragged all-to-all the buffer is padded
                     for the worst case, every local assignment routed to one device
The routed experts' weights need no reduction over the expert axes: the all-to-all's transpose brings every
token's contribution to the device that holds the expert.
"""

from __future__ import annotations

from jaxpar.config.choices import REMAT_KEEPING_EXITS_ONLY, REMAT_RECOMPUTING_EXPERTS
from jaxpar.config.mesh_axes import TENSOR
from jaxpar.config.schema import Config
from jaxpar.parallel.expert import all_to_all_buffer, all_to_alls_per_block, capacity

# The working set of one MoE block's backward at its peak, in elements of the compute dtype per row its experts run
# (`expert_rows`): HIDDEN_BUFFERS buffers of the experts' hidden width F/t (the recomputed gate and up projections,
# the hidden activation and their gradients, as many as are live at once) and ROW_BUFFERS of the model width D (the
# rows received and sent back, their gradients, the partial input gradients of the gate and up projections). Read
# from the GPU compiler's buffer assignment at the step's peak (deviceless H100 compile, the live values at the
# peak of configs/mixtral_8x7b.yaml: 4 bf16 [R, 14336] and 5 bf16 [R, 4096] with R = 131072 rows).
HIDDEN_BUFFERS = 4
ROW_BUFFERS = 5


def all_to_all_elements(cfg: Config, d) -> int:
    """The size of one MoE all-to-all's buffer (dispatch or combine) on one device, in elements of the compute dtype
    (`jaxpar.parallel.expert.all_to_all_buffer`, the layer's own count): capacity routing E*C*b*D, dropless
    ep*b*T*k*D (padded for the worst case). 0 without expert axes. `d`: `jaxpar.analysis.planner.dims.dims(cfg,
    platform)`."""
    moe = cfg.model.moe
    if not d.expert_axes:
        return 0
    return all_to_all_buffer(
        moe.routing, d.ep, d.b, d.r, moe.top_k, moe.num_experts, cfg.model.d_model, moe.capacity_factor
    )


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
    all-to-all rows of `terms`, the step's `jaxpar.analysis.planner.comm.CollectiveTerm`s), "all_to_all_count"}.
    `d`: `jaxpar.analysis.planner.dims.dims`; `state`: `jaxpar.analysis.planner.plan.state_bytes`."""
    moe = cfg.model.moe
    if not moe.enabled:
        return None
    a2a = [t for t in terms if t.kind == "all-to-all"]
    return {
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "routing": moe.routing,
        "axes": list(d.expert_axes),
        "ep": d.ep,
        "experts_per_device": moe.num_experts // d.ep,
        "expert_params_per_rank": state["n_expert_params"],
        "all_to_all_bytes": sum(t.bytes for t in a2a),
        "all_to_all_count": sum(t.count for t in a2a),
    }


def expert_rows(cfg: Config, d) -> int:
    """R, the rows one device's routed experts run per MoE block and microbatch: every assignment its experts
    receive, padding included. Capacity routing: E*C*b (each local expert's C slots from each of the ep sources);
    dropless: A = b*r*k local assignments without expert parallelism, else the rows of the receive buffer
    (`all_to_all_elements` / D). 0 for a dense model. `d`: `jaxpar.analysis.planner.dims.dims`."""
    moe = cfg.model.moe
    if not moe.enabled:
        return 0
    if d.expert_axes:
        return all_to_all_elements(cfg, d) // cfg.model.d_model
    if moe.routing == "capacity":
        return moe.num_experts * capacity(d.r, moe.top_k, moe.num_experts, moe.capacity_factor) * d.b
    return d.b * d.r * moe.top_k


def working_bytes(cfg: Config, d) -> int:
    """Bytes one MoE block's backward holds at its peak on one device (module constants HIDDEN_BUFFERS and
    ROW_BUFFERS, measured): (HIDDEN_BUFFERS * R * F/t + ROW_BUFFERS * R * D) * Bc with R = `expert_rows`, F the
    experts' hidden width. 0 for a dense model. Like the attention's working set it is one layer's, at one moment."""
    moe, mdl = cfg.model.moe, cfg.model
    rows = expert_rows(cfg, d)
    f_t = (moe.d_expert or mdl.d_ff) // d.shape[TENSOR]
    return (HIDDEN_BUFFERS * rows * f_t + ROW_BUFFERS * rows * mdl.d_model) * d.compute_bytes


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
    if moe.routing == "capacity":
        combined = moe.num_experts * capacity(d.r, moe.top_k, moe.num_experts, moe.capacity_factor) * d.b
    else:
        combined = d.b * d.r * moe.top_k
    dispatched = 0 if mdl.remat in REMAT_KEEPING_EXITS_ONLY else expert_rows(cfg, d)
    return (combined + dispatched) * mdl.d_model * d.compute_bytes
