"""jaxpar.training.compiled_memory: XLA's per-device memory analysis as ints, and the one peak formula every report
uses."""

import jax
import jax.numpy as jnp

from jaxpar.training.compiled_memory import memory_analysis_bytes, peak_bytes


def test_donated_output_is_counted_once():
    x = jnp.ones((256, 256), jnp.float32)  # 256 KiB
    donated = jax.jit(lambda a: a * 2.0, donate_argnums=0).lower(x).compile()
    mem = memory_analysis_bytes(donated)
    assert mem["argument_bytes"] == mem["output_bytes"] == mem["alias_bytes"] == x.nbytes
    assert mem["peak_bytes"] == peak_bytes(mem) == x.nbytes + mem["temp_bytes"]
    kept = memory_analysis_bytes(jax.jit(lambda a: a * 2.0).lower(x).compile())
    assert kept["alias_bytes"] == 0 and kept["peak_bytes"] == 2 * x.nbytes + kept["temp_bytes"]
    assert all(isinstance(v, int) for k, v in mem.items() if k != "xla_peak_bytes")


def test_reports_read_the_peak_they_are_given():
    """The sweep's compiled summary takes the producer's peak, never its own arithmetic."""
    from jaxpar.analysis.sweep.run import _compiled_summary

    ma = {"argument_bytes": 1, "output_bytes": 1, "alias_bytes": 0, "temp_bytes": 1, "peak_bytes": 7}
    compiled = {"memory_analysis": ma, "state": {"params_plus_opt_state": 1, "ratio": 1.0}, "collectives": []}
    assert _compiled_summary(compiled)["peak_bytes"] == 7
