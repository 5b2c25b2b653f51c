"""Benchmarks' measurements: step timing (`timing`), the baselines jaxpar's step is compared with (`baselines`),
the ratio tables of `benchmarks/all.py` (`report`), the tensor collectives' bytes against the compiler's
(`tensor_bytes`) and the host memory of Hugging Face weights in and out (`hf_memory`)."""
