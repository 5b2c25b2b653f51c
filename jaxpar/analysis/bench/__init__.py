"""Benchmarks' measurements: step timing (`timing`), the baselines jaxpar's step is compared with (`baselines`),
the ratio tables of `benchmarks/all.py` (`report`) and the tensor collectives' bytes against the compiler's
(`tensor_bytes`)."""
