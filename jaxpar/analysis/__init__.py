"""Analysis tools built on the training core: the analytic planner (`plan`, `plan_comm`, `plan_dims`), its checks
against XLA (`plan_compile` on simulated CPU devices with the `compile_options`, `plan_gpu` with XLA's GPU
compiler and the `gpu_targets`), the shipped configs' GPU proof (`gpu_check`), mesh sweeps (`sweep`, `sweep_gpu`,
`sweep_report`), HLO reading (`hlo`, `collective_order`), communication and memory formulas (`comm`, `memory`),
reports and benchmarks (`plan_report`, `pipeline_report`, `bench`, `bench_baselines`, `bench_report`, with the
byte `units`).

The core (config, mesh, sharding, model, parallel, train, data, checkpoint, metrics) never imports this package.
"""
