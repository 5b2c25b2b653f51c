"""NVIDIA GPU compile targets: descriptions XLA's GPU compiler takes instead of a device, and clusters of them.

A target is a `stream_executor.GpuTargetConfigProto` in protobuf text format, shipped as package data
(`<name>.txtpb`), written field by field from each GPU's public specifications (the sources are named in each
file). jax's CUDA plugin parses it when asked for a compile-only topology (`jaxpar.analysis.gpu.deviceless`):

    topologies.get_topology_desc(platform="cuda", target_config=target("h100").text, topology="1x8x8")

What the fields do (checked with the gpu-compile extra's CUDA plugin by deleting one field at a time and compiling a
sharded matmul + all-reduce; an unknown field name is refused by the parser, so a file written for a newer XLA
fails at `get_topology_desc` with "Failed to parse GpuTargetConfigProto"):
  needed to compile at all
    cuda_compute_capability    selects the PTX target (sm_XY; `feature_extension: ACCELERATED_FEATURES` is the
                               "a" variant real Hopper/Blackwell devices report); missing, ptxas refuses sm_0.0
    threads_per_warp,          divisors in launch-dimension arithmetic: missing (0), the compiler process dies
    block_dim_limit_x          with SIGFPE
    shared_memory_per_block_optin   the shared-memory budget of Triton GEMM fusions: missing (0), matmuls fail
                               with RESOURCE_EXHAUSTED "Shared memory size limit exceeded"
  used by the compiler's cost models and tiling (missing still compiles, with other fusion/tile choices)
    core_count, fpus_per_core, clock_rate_ghz, memory_bandwidth, l2_cache_size, threads_per_block_limit,
    threads_per_core_limit, shared_memory_per_block, shared_memory_per_core, registers_per_*_limit,
    block_dim_limit_y/z. They move the peak: llama_7b (data=8, fsdp=8, one 4096-token sequence per GPU) needs
    11.36 GB per H100 but 10.29 GB per H200, the same chip with more memory bandwidth.
  memory
    device_memory_size         bytes per GPU, the compiler's memory budget; `fits` in
                               `jaxpar.analysis.gpu.deviceless` compares the compiled peak with `MEMORY_FRACTION`
                               of it. The same 7B step compiled to the same peak with 80e9, 85e9 and 141e9 here
                               (far below all three). The files give the datasheet capacity in decimal GB, which
                               is below what CUDA reports on these GPUs.
  versions and identity
    runtime_version, dnn_version_info   CUDA runtime and cuDNN the compiler may assume (some cuDNN fusions are
                               gated on them); left out, the step compiled the same here, cuDNN attention included
    platform_name              "CUDA"
    device_description_str     becomes `jax.Device.device_kind` of the compile-only devices; the key of the dense
                               bf16 peak in `jaxpar.model.flops.PEAK_FLOPS` (the one table of peaks, used for MFU)

A cluster is named `KIND:NODESxGPUS` (e.g. `h100:8x8`: 8 nodes of 8 H100s). The plugin's topology string is
`<partitions>x<hosts per partition>x<devices per host>`; a cluster is one partition (`1xNODESxGPUS`): the
compiled step's HLO was identical for `1x8x8` and `8x1x8` (llama_7b, data=8 fsdp=8).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re

from jaxpar.model import flops

# The share of each GPU's memory a jax process may use: jax's allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of it
# at start (default 0.75); tools/slurm_gpu.sbatch sets 0.90, leaving the rest to NCCL and the CUDA context. A
# step "fits" when its per-device peak is at most this share (`GpuTarget.usable_bytes`).
MEMORY_FRACTION = 0.90

# Short name -> file; the name is what `--target`-style options and cluster names use.
TARGET_FILES = {"h100": "h100.txtpb", "h200": "h200.txtpb", "a100": "a100.txtpb", "b200": "b200.txtpb"}
_TOKEN = re.compile(r'\s*(?:(#[^\n]*)|([A-Za-z_][A-Za-z0-9_]*)|(\{)|(\})|(:)|("(?:[^"\\]|\\.)*")|([^\s{}:#"]+))')
_CLUSTER = re.compile(r"^([a-z0-9]+):(\d+)x(\d+)$")


def parse_text_proto(text: str) -> dict:
    """Parses the subset of protobuf text format the target files use: `field: scalar`, `field { ... }` and
    `field: { ... }`, `#` comments. Repeated fields become lists. Scalars stay strings unless they parse as int
    or float; quoted strings lose their quotes.

    Raises:
      ValueError: unbalanced braces or a field without a value (with the offending position).
    """
    pos, name = 0, None
    stack: list[tuple[dict, str]] = []  # the enclosing messages of `current`, with the field it is under
    current: dict = {}

    def put(container: dict, key: str, value) -> None:
        if key in container:
            old = container[key]
            container[key] = (old if isinstance(old, list) else [old]) + [value]
        else:
            container[key] = value

    colon = False
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            if text[pos:].strip():
                raise ValueError(f"target description: cannot parse at character {pos}: {text[pos : pos + 30]!r}")
            break
        pos = m.end()
        comment, ident, open_, close, col, quoted, bare = m.groups()
        if comment:
            continue
        if col:
            colon = True
        elif open_:
            if name is None:
                raise ValueError(f"target description: '{{' without a field name at character {pos}")
            stack.append((current, name))
            current, name, colon = {}, None, False
        elif close:
            if not stack:
                raise ValueError(f"target description: unbalanced '}}' at character {pos}")
            child = current
            current, key = stack.pop()
            put(current, key, child)
        elif name is not None and colon:
            put(current, name, _scalar(quoted[1:-1] if quoted else ident or bare))
            name, colon = None, False
        elif ident:
            if name is not None:
                raise ValueError(f"target description: field {name!r} has no value (at character {pos})")
            name = ident
        else:
            raise ValueError(f"target description: unexpected {m.group().strip()!r} at character {pos}")
    if stack or name is not None:
        raise ValueError("target description: unbalanced '{' or a field without a value at the end")
    return current


def _scalar(token: str):
    for kind in (int, float):
        try:
            return kind(token)
        except ValueError:
            pass
    return token


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU kind as a compile target.

    Attributes:
      name: short name (a key of `TARGET_FILES`), e.g. "h100".
      text: the GpuTargetConfigProto text given to the CUDA plugin.
      device_kind: `device_description_str` (what `jax.Device.device_kind` reports), e.g. "NVIDIA H100 80GB HBM3".
      memory_bytes: `device_memory_size`, bytes of memory per GPU.
      compute_capability: (major, minor), e.g. (9, 0).
      peak_flops: dense bf16 peak FLOP/s per GPU from `jaxpar.model.flops.PEAK_FLOPS` (for MFU).
    """

    name: str
    text: str
    device_kind: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    peak_flops: float

    @property
    def usable_bytes(self) -> float:
        """Bytes per GPU a step may peak at: `MEMORY_FRACTION` of `memory_bytes`."""
        return MEMORY_FRACTION * self.memory_bytes


def target_names() -> tuple[str, ...]:
    """The shipped targets' short names, sorted."""
    return tuple(sorted(TARGET_FILES))


def target_from_text(name: str, text: str) -> GpuTarget:
    """A `GpuTarget` from description text (checks the fields every compile needs; see the module docstring).

    Raises:
      ValueError: unparsable text; a needed field missing; no dense bf16 peak known for its device kind.
    """
    proto = parse_text_proto(text)
    info = proto.get("gpu_device_info")
    if not isinstance(info, dict):
        raise ValueError(f"target {name!r}: no gpu_device_info {{ ... }} block")
    needed = (
        "cuda_compute_capability",
        "threads_per_warp",
        "block_dim_limit_x",
        "shared_memory_per_block_optin",
        "device_memory_size",
    )
    missing = [f for f in needed if f not in info] + [f for f in ("device_description_str",) if f not in proto]
    if missing:
        raise ValueError(
            f"target {name!r}: missing field(s) {', '.join(missing)} (needed to compile; see "
            f"jaxpar.analysis.gpu.targets)"
        )
    if proto.get("platform_name") != "CUDA":
        raise ValueError(f'target {name!r}: platform_name must be "CUDA", got {proto.get("platform_name")!r}')
    kind = proto["device_description_str"]
    peak = flops.peak_flops(kind)
    if peak is None:
        raise ValueError(
            f"target {name!r}: no dense bf16 peak for device kind {kind!r} in jaxpar.model.flops.PEAK_FLOPS; "
            f"add it there (one table of peaks)"
        )
    cc = info["cuda_compute_capability"]
    return GpuTarget(
        name=name,
        text=text,
        device_kind=kind,
        memory_bytes=int(info["device_memory_size"]),
        compute_capability=(int(cc.get("major", 0)), int(cc.get("minor", 0))),
        peak_flops=peak,
    )


def target(name: str) -> GpuTarget:
    """The shipped target `name` (case-insensitive), e.g. `target("h100")`.

    Raises:
      ValueError: unknown name (the message lists the shipped ones).
    """
    key = name.strip().lower()
    if key not in TARGET_FILES:
        raise ValueError(f"unknown GPU target {name!r}; shipped targets: {', '.join(target_names())}")
    text = importlib.resources.files(__name__).joinpath(TARGET_FILES[key]).read_text(encoding="utf-8")
    return target_from_text(key, text)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` GPUs of one target."""

    target: GpuTarget
    nodes: int
    gpus_per_node: int

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def topology(self) -> str:
        """The CUDA plugin's topology string: one partition of `nodes` hosts of `gpus_per_node` devices."""
        return f"1x{self.nodes}x{self.gpus_per_node}"

    @property
    def name(self) -> str:
        return f"{self.target.name}:{self.nodes}x{self.gpus_per_node}"


def cluster(target_name: str, nodes: int, gpus_per_node: int) -> Cluster:
    """The cluster of `nodes` x `gpus_per_node` GPUs of target `target_name`.

    Raises:
      ValueError: unknown target; nodes or gpus_per_node not a positive integer.
    """
    for key, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return Cluster(target(target_name), nodes, gpus_per_node)


def parse_cluster(text: str) -> Cluster:
    """A cluster from its name `KIND:NODESxGPUS`, e.g. "h100:8x8" (8 nodes of 8 H100s, 64 GPUs).

    Raises:
      ValueError: not of that form, an unknown kind, or a count below 1.
    """
    m = _CLUSTER.match(text.strip().lower())
    if m is None:
        raise ValueError(
            f"cluster {text!r}: expected KIND:NODESxGPUS such as h100:8x8 (kinds: {', '.join(target_names())})"
        )
    return cluster(m.group(1), int(m.group(2)), int(m.group(3)))
