"""The train step and the loop around it.

The step, read top-down: `plan` (StepPlan, build_plan: everything static, precision and attention resolved from
the mesh), `state` (init_state, abstract_state), `step` (the grad function, train and eval steps) with its parts
`forward` (one microbatch), `grad_reduction` and `pipelined`; then `loss`, `optimizer` and `moe_loss`.
The loop (`loop.train`) starts a run (`start_state`), runs the steps and calls its `hooks`.
"""
