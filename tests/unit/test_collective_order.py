"""Every device issues the train step's collectives in one order (`jaxpar.analysis.hlo.collective_order`).

XLA:CPU orders collectives only by when they start, so a collective scheduled after a loop of collectives that it
does not depend on lets devices issue them in different orders; with blocking in-process collectives that
deadlocked the 1F1B step on 16 simulated devices (tests/parity/test_pipeline.py runs that mesh). The check reads the
compiled program, so it runs on 8 devices in seconds:

* the pipelined step (1F1B at p = 2 and p = 4, GPipe, 1F1B with tensor parallelism, interleaved 1F1B with its
  permutes into and out of chunk order; with one layer per chunk, whose weights' fsdp gathers sit outside any
  layer loop, this check found 9 gathers unordered against the embedding's cond until the chunk's weights were
  ordered after the stage input) and a data x fsdp x tensor step with accumulation compile to programs with no
  collective free to start while a loop runs, and no loop free to start before an earlier collective ends
  (until a 1F1B tick ordered its embedding-gradient cond after the backward's weight gradients, 18 fsdp
  reduce-scatters at p = 4 were free against that cond);
* with the data dependencies that order a 1F1B tick removed (`pipeline.ordered_after` made the identity), the same
  check finds the pairs: the forward's loop followed by the backward's collectives and the permutes; so does the
  GPU setting, which leaves the order to the compiler (`StageParts.order_collectives`);
* the whole train step is compiled, optimizer included: XLA moves the last tick's embedding-gradient cond out of
  the 1F1B loop, and without `step._after_every_reduction` the optimizer's all-reduces (global norm,
  finiteness) are unordered against it (across processes that pair corrupted about one step in 40 under load).
"""

import jax
import pytest
from step_helpers import FP32, compile_fast, device_batch, host_batch, make_plan, quick_compile

from jaxpar.analysis.hlo.collective_order import unordered_collectives
from jaxpar.parallel import pipeline, pipeline_1f1b
from jaxpar.training import forward, step
from jaxpar.training.state import abstract_state
from jaxpar.training.step import make_train_step

VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6)
LAYOUTS = {
    "1f1b_p2_data2_fsdp2": ("mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.microbatches=2"),
    "1f1b_p4_fsdp2": ("mesh.pipeline=4", "mesh.fsdp=2", "pipeline.microbatches=4"),
    "1f1b_p2_fsdp2_tensor2_sp": ("mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.microbatches=2"),
    "1f1b_v2_p2_data2_fsdp2_tensor2_sp": (
        "mesh.pipeline=2",
        "mesh.data=2",
        "mesh.tensor=2",
        "pipeline.microbatches=2",
        "pipeline.virtual_stages=2",
    ),
    "1f1b_v2_p4_fsdp2": (
        "mesh.pipeline=4",
        "mesh.fsdp=2",
        "pipeline.microbatches=4",
        "pipeline.virtual_stages=2",
        "model.n_layers=8",
    ),
    "1f1b_v2_p4_fsdp2_recompute": (
        "mesh.pipeline=4",
        "mesh.fsdp=2",
        "pipeline.microbatches=4",
        "pipeline.virtual_stages=2",
        "model.n_layers=8",
        "pipeline.recompute=true",
    ),
    "gpipe_p2_data2_fsdp2": (
        "mesh.pipeline=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "pipeline.microbatches=2",
        "pipeline.schedule=gpipe",
    ),
    # the zero-bubble slot loop: collectives inside the switch's branches, the two permutes after it
    "zbh1_p2_data2_fsdp2_tensor2_sp": (
        "mesh.pipeline=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "pipeline.microbatches=2",
        "pipeline.schedule=zb-h1",
    ),
    "zbv_p4_fsdp2": (
        "mesh.pipeline=4",
        "mesh.fsdp=2",
        "pipeline.microbatches=4",
        "pipeline.schedule=zb-v",
        "pipeline.virtual_stages=2",
        "model.n_layers=8",
    ),
    # an uneven split: the moves into the stage layout and back, the padding's skip conds holding the layers'
    # fsdp gathers and tensor collectives inside the layer scan, under zb-h1's slot switch
    "zbh1_p2_fsdp2_tensor2_sp_uneven": (
        "mesh.pipeline=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "pipeline.microbatches=2",
        "pipeline.schedule=zb-h1",
        "pipeline.stage_layers=[3,1]",
    ),
    # the vocabulary-parallel head: all-reduces over pipeline in every steady tick, beside the permutes
    "1f1b_p2_fsdp2_tensor2_sp_vocab": (
        "mesh.pipeline=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "pipeline.microbatches=2",
        "pipeline.vocab_parallel=true",
    ),
    # tiny.yaml's layout (the README's runs, one and two processes) with accumulation: its head's fsdp gathers and
    # their reduce-scatters were free against the layer loops until the head's weights were ordered after them
    "data2_fsdp2_tensor2_accum2": ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.grad_accum_steps=2"),
    # examples/own_model.py's layout, which tests/parity/test_own_model.py runs as 2 processes
    "1f1b_p2_data2_tensor2_sp_zero3": (
        "mesh.pipeline=2",
        "mesh.data=2",
        "mesh.tensor=2",
        "pipeline.microbatches=4",
        "optimizer.zero_stage=3",
    ),
}


def _compiled_step_hlo(overrides) -> str:
    with quick_compile():
        plan = make_plan(
            [
                *FP32,
                "model.n_layers=4",
                f"train.global_batch_size={len(VALID)}",
                "mesh.data=1",
                "mesh.fsdp=1",
                *overrides,
            ],
            jax.devices()[:8],
        )
        assert plan.mesh.size == 8
        state = abstract_state(plan)  # compiled, not run: shapes and shardings suffice
        batch = device_batch(plan, host_batch(VALID, 8, 0))
        return compile_fast(make_train_step(plan), state, batch).as_text()


# The default suite checks one layout of each kind (1F1B with tensor parallelism, interleaved at p = 2 and, with
# recompute, at p = 4, GPipe, no pipeline); -m slow also the plain 1F1B ones.
SLOW_LAYOUTS = {"1f1b_p2_data2_fsdp2", "1f1b_p4_fsdp2", "1f1b_v2_p4_fsdp2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n in SLOW_LAYOUTS)) for n in LAYOUTS])
def test_every_device_issues_collectives_in_one_order(name):
    hlo = _compiled_step_hlo(LAYOUTS[name])
    assert "while(" in hlo and ("collective-permute" in hlo) == name.startswith(("1f1b", "gpipe", "zb"))
    assert unordered_collectives(hlo) == []


@pytest.mark.parametrize("name", ["1f1b_p2_fsdp2_tensor2_sp", "gpipe_p2_data2_fsdp2"])
def test_without_the_tick_dependencies_pipelines_are_unordered(monkeypatch, name):
    """The check can fail: without `jaxpar.parallel.pipeline.ordered_after`, 1F1B with tensor parallelism leaves a
    tensor all-reduce free against a loop of collectives, and GPipe its edge conds, layer-gather loops and
    permutes. (1F1B without tensor parallelism is ordered by its data flow alone: since the last stage's head
    seeds the backward in the tick of its forward, every stage's backward reads the forward's output.)"""
    for module in (pipeline, pipeline_1f1b):  # the schedules' modules, each with its own name for it
        monkeypatch.setattr(module, "ordered_after", lambda tree, deps: tree)
    pairs = unordered_collectives(_compiled_step_hlo(LAYOUTS[name]), after_loops_only=True)
    later = {opcode for _, _, _, opcode in pairs}
    assert later & {"all-reduce", "collective-permute", "while", "conditional"}, pairs


def test_with_the_gpu_setting_the_cpu_program_is_unordered(monkeypatch):
    """On GPUs the schedules leave their collectives to the compiler's order (`StageParts.order_collectives`,
    `pipeline.needs_collective_order`), so the forward permute can run under the backward; compiled for CPU with
    that setting, 1F1B with tensor parallelism has collectives free against its loops: the CPU program needs the
    dependencies it keeps."""
    monkeypatch.setattr(pipeline, "needs_collective_order", lambda platform: False)
    assert unordered_collectives(_compiled_step_hlo(LAYOUTS["1f1b_p2_fsdp2_tensor2_sp"]))


def test_without_ordering_the_gradients_the_step_is_unordered(monkeypatch):
    """The check can fail on the step's side too: without `step._after_every_reduction` the 1F1B step of
    examples/own_model.py leaves all-reduces (the other gradients' reductions, the optimizer's global norm) free
    against the embedding-gradient cond that XLA moved out of the loop (and the loop itself)."""
    monkeypatch.setattr(step, "_after_every_reduction", lambda tree: tree)
    pairs = unordered_collectives(_compiled_step_hlo(LAYOUTS["1f1b_p2_data2_tensor2_sp_zero3"]))
    assert any("conditional" in (earlier.split(".")[0], opcode) for _, earlier, _, opcode in pairs), pairs


def test_without_ordering_the_head_the_plain_step_is_unordered(monkeypatch):
    """Without the head's weights ordered after the layer loop (`jaxpar.training.forward.loss_body`), the step of
    tiny.yaml's layout leaves its head's fsdp gradient reduce-scatters free against the backward's layer loop
    (without accumulation, the head's all-gathers against the forward's too)."""
    monkeypatch.setattr(forward, "ordered_after", lambda tree, deps: tree)
    pairs = unordered_collectives(_compiled_step_hlo(LAYOUTS["data2_fsdp2_tensor2_accum2"]))
    earlier = {name.split(".")[0] for _, name, _, _ in pairs}
    assert "reduce_scatter" in earlier and {opcode for *_, opcode in pairs} == {"while"}, pairs
