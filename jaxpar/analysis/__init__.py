"""Analysis tools built on the training core, one subpackage per concern: `planner` (the analytic plan and its check
against XLA:CPU), `hlo` (reading compiled programs), `gpu` (GPU clusters compiled for without a GPU), `sweep` (mesh
sweeps) and `bench` (benchmarks' measurements).

The core (config, parallel, model, data, checkpoint, training) never imports this package.
"""
