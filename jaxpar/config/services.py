"""Checks of the sections that connect a run to services outside it: `metrics` (Weights & Biases) and
`distributed` (the coordinator every process joins). Called by `jaxpar.config.validate.validate_config`; no jax.
"""

from __future__ import annotations

import os

from jaxpar.config.checks import check_choice, check_not_empty, check_positive
from jaxpar.config.choices import WANDB_MODES
from jaxpar.config.errors import ConfigError
from jaxpar.config.extras import WANDB_FEATURE, installed, missing_message
from jaxpar.config.keys import example
from jaxpar.config.schema import DistributedConfig, MetricsConfig

_MAX_PORT = 65535


def _wandb_goes_online(mode: str) -> bool:
    """Whether a W&B run in `mode` streams: "online", or "" with WANDB_MODE unset or online."""
    if mode == "":
        mode = os.environ.get("WANDB_MODE", "online")
    return mode in ("online", "run")


def _wandb_api_key() -> bool:
    """Whether W&B has an API key here: WANDB_API_KEY, or an api.wandb.ai entry in the netrc file that `wandb
    login` writes (NETRC or ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def check_metrics(mc: MetricsConfig) -> None:
    """The `metrics:` section: the W&B mode and project, and with `metrics.wandb` the extra and an API key when
    the run streams.

    Raises:
      ConfigError: naming the key and the fix.
    """
    check_choice("metrics.wandb_mode", mc.wandb_mode, WANDB_MODES)
    check_not_empty("metrics.wandb_project", mc.wandb_project, "the W&B project")
    if mc.wandb and not installed("wandb"):
        raise ConfigError(missing_message("wandb", WANDB_FEATURE, instead="set metrics.wandb=false"))
    if mc.wandb and _wandb_goes_online(mc.wandb_mode) and not _wandb_api_key():
        raise ConfigError(
            f"metrics.wandb=true with metrics.wandb_mode={mc.wandb_mode!r} streams to Weights & "
            "Biases, but no API key is configured (WANDB_API_KEY, or `wandb login`); log in, or set "
            "metrics.wandb_mode=offline (upload later with `wandb sync`)"
        )


def check_distributed(dc: DistributedConfig) -> None:
    """The `distributed:` section's ranges: the coordinator address is empty (from the environment) or
    HOST:PORT, the process count >= 0 (0: from the environment), the process id >= -1 (-1: from the environment)
    and below a given count, the timeout > 0. (Whether the processes can meet is found when they start:
    `jaxpar.parallel.distributed`.)

    Raises:
      ConfigError: naming the key and the fix.
    """
    address = dc.coordinator_address
    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= _MAX_PORT:
            raise ConfigError(
                f"distributed.coordinator_address={address!r} is not HOST:PORT; give process 0's host and a free "
                f"port, e.g. distributed.coordinator_address=10.0.0.1:1234, or leave it empty to take the "
                f"environment's (JAXPAR_COORDINATOR_ADDRESS, which jaxpar-launch sets)"
            )
    if dc.num_processes < 0:
        raise ConfigError(
            f"distributed.num_processes={dc.num_processes} must be >= 0 (0: from the environment); "
            f"{example('distributed.num_processes')}"
        )
    if dc.process_id < -1 or (dc.num_processes and dc.process_id >= dc.num_processes):
        raise ConfigError(
            f"distributed.process_id={dc.process_id} must be -1 (from the environment) or lie in [0, "
            f"{dc.num_processes or 'distributed.num_processes'}); {example('distributed.process_id')}"
        )
    check_positive("distributed.initialization_timeout_s", dc.initialization_timeout_s)
