"""The optimized HLO text of a compiled program, the input of every reader in `jaxpar.analysis.hlo`. No jax at
import (the type is for the checker only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax


def compiled_hlo_text(compiled: jax.stages.Compiled) -> str:
    """`compiled.as_text()`: the per-device HLO module after the backend's passes (scheduled, with the
    partitioner's collectives).

    Raises:
      RuntimeError: the backend gives no text for compiled programs (`as_text()` returns None); XLA:CPU and
        XLA:GPU give one.
    """
    text = compiled.as_text()
    if text is None:
        raise RuntimeError(f"the {compiled.__class__.__name__}'s backend gives no HLO text (as_text() is None)")
    return text
