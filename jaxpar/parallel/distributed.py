"""Multi-process start: `jax.distributed.initialize` with explicit arguments or the cluster's own detection.

Call `initialize` before any device work (the trainer's CLI does, before validating the config against the
device count). Where the arguments come from, first match wins:

1. the `distributed` config section (`distributed.coordinator_address`, `num_processes`, `process_id`);
2. the environment: `JAXPAR_COORDINATOR_ADDRESS`, `JAXPAR_NUM_PROCESSES`, `JAXPAR_PROCESS_ID` (set by
   `jaxpar-launch` for local multi-process runs);
3. a cluster jax detects by itself (SLURM, Open MPI, Kubernetes/JobSet, Cloud TPU, ...): `jax.distributed
   .initialize()` with no arguments;
4. otherwise a single process: nothing to do.
"""

from __future__ import annotations

import os

import jax

from jaxpar.config.errors import ConfigError
from jaxpar.config.schema import DistributedConfig

ENV_COORDINATOR = "JAXPAR_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
_CLUSTER_ENV = (
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_SIZE",
    "JOBSET_NAME",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


def _explicit(cfg: DistributedConfig) -> tuple[str, int, int] | None:
    address = cfg.coordinator_address or os.environ.get(ENV_COORDINATOR, "")
    if not address:
        return None
    try:
        num = cfg.num_processes or int(os.environ.get(ENV_NUM_PROCESSES, "0"))
        pid = cfg.process_id if cfg.process_id >= 0 else int(os.environ.get(ENV_PROCESS_ID, "-1"))
    except ValueError as e:
        raise ConfigError(f"{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} must be integers: {e}") from e
    if num < 1 or not 0 <= pid < num:
        raise ConfigError(
            f"distributed.coordinator_address={address!r} needs distributed.num_processes >= 1 and "
            f"0 <= distributed.process_id < num_processes (got {num} and {pid}); set them in the config or "
            f"in {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}"
        )
    return address, num, pid


def initialize(cfg: DistributedConfig | None = None) -> bool:
    """Starts jax's distributed runtime when this is a multi-process run; returns whether it did. `cfg`: the
    config's `distributed` section (default: its defaults, so the environment decides).

    Raises:
      ConfigError: a coordinator address without a valid process count and id.
    """
    cfg = cfg if cfg is not None else DistributedConfig()
    explicit = _explicit(cfg)
    if explicit is not None:
        address, num, pid = explicit
        jax.distributed.initialize(
            address, num_processes=num, process_id=pid, initialization_timeout=cfg.initialization_timeout_s
        )
        return True
    if any(k in os.environ for k in _CLUSTER_ENV) and cfg.auto_detect:
        jax.distributed.initialize(initialization_timeout=cfg.initialization_timeout_s)
        return True
    return False


def describe_process() -> str:
    """One line naming this process, its local devices and the global device count."""
    local = ",".join(str(d.id) for d in jax.local_devices())
    return (
        f"process {jax.process_index()}/{jax.process_count()}: local devices [{local}] of "
        f"{jax.device_count()} ({jax.devices()[0].platform})"
    )
