"""The analytic planner: per-device bytes of model state and activations and the collectives of one train step
(`plan`, with the model's view in `dims`, the collectives in `comm` and `experts`, the state formulas in `memory`,
the pipeline schedule arithmetic in `pipeline`), the plan checked against XLA:CPU's compiled step (`compiled`),
and its text reports (`report`)."""
