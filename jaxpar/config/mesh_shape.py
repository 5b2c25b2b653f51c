"""The mesh's sizes at a device count (`resolve_mesh_shape`), and advice that fits when they do not.

A config's `mesh:` section gives each axis a size, or -1 for one axis that takes the devices the others leave.
When the sizes cannot cover the devices, the message names what would: the device count the config's mesh was
written for (a cluster config fixes it), or the axis sizes that fit these devices (`-1` only where the other
axes divide the device count, so that -1 can fill it). No jax.
"""

from __future__ import annotations

import math

from jaxpar.config.errors import ConfigError
from jaxpar.config.mesh_axes import mesh_sizes
from jaxpar.config.schema import Config


def _devices_hint(needed: int, multiple: bool) -> str:
    """How to run on the devices the mesh was written for."""
    count = f"a multiple of {needed}" if multiple else f"{needed}"
    return (
        f"run on {count} devices (jaxpar-plan --devices {needed} plans for them; jaxpar-train --cpu-devices "
        f"{needed}, or JAX_NUM_CPU_DEVICES={needed}, simulates them on CPU)"
    )


def _fitting_sizes(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """Each axis of `sizes` (none -1) lowered to the largest size that keeps the product dividing `num_devices`,
    axis by axis in config order: {axis: new size} for the axes that change."""
    left, changed = num_devices, {}
    for axis, size in sizes.items():
        fits = math.gcd(size, left)
        left //= fits
        if fits != size:
            changed[axis] = fits
    return changed


def _assignments(changes: dict[str, int]) -> str:
    return " ".join(f"mesh.{a}={s}" for a, s in changes.items())


def mesh_advice(sizes: dict[str, int], num_devices: int) -> str:
    """The fix for mesh `sizes` ({axis: size}, at most one -1, others >= 1) that do not cover `num_devices`:
    other axis sizes that fit (one axis, with `-1` offered where the others divide the device count; else
    several), and the device count the mesh was written for."""
    fill = next((a for a, s in sizes.items() if s == -1), None)
    fixed = {a: s for a, s in sizes.items() if s != -1}
    needed = math.prod(fixed.values())
    if fill is not None:  # the fixed axes' product does not divide the devices: lower them
        fix = f"or lower the other axes, e.g. {_assignments(_fitting_sizes(fixed, num_devices))}"
        return f"{_devices_hint(needed, True)}, {fix}"
    single = []  # one axis changed, the others kept: where the others' product divides the devices
    for axis in sizes:
        others = needed // sizes[axis]
        if num_devices % others == 0:
            single.append(f"mesh.{axis}={num_devices // others} (or mesh.{axis}=-1)")
    if single:
        fix = f"or change one axis: {' or '.join(single)}"
    else:
        fill_axis = max(sizes, key=lambda a: sizes[a])  # the largest axis takes what the lowered others leave
        rest = {a: s for a, s in sizes.items() if a != fill_axis}
        fix = f"or change the sizes, e.g. {_assignments({**_fitting_sizes(rest, num_devices), fill_axis: -1})}"
    return f"{_devices_hint(needed, False)}, {fix}"


def resolve_mesh_shape(cfg: Config, num_devices: int) -> dict[str, int]:
    """Returns {axis: size} for data, fsdp, tensor, pipeline with any -1 filled in.

    Raises:
      ConfigError: a device count below 1, more than one -1, a size below -1 or 0, or a product that does not
        equal `num_devices` (the message names the sizes that fit and the device count the mesh needs).
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigError(
            f"device count {num_devices!r}: a mesh needs at least 1 device; give a positive device "
            f"count (e.g. --devices 8)"
        )
    sizes = mesh_sizes(cfg.mesh)
    fill = [a for a, s in sizes.items() if s == -1]
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            default = mesh_sizes(type(cfg.mesh)())[axis]
            raise ConfigError(
                f"mesh.{axis}={size}: a mesh axis size is a positive integer, or -1 to fill; e.g. mesh.{axis}={default}"
            )
    if len(fill) > 1:
        raise ConfigError(
            f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in fill)}; give the others a size, "
            f"e.g. {' '.join(f'mesh.{a}=1' for a in fill[1:])}"
        )
    fixed = math.prod(s for s in sizes.values() if s != -1)
    others = " x ".join(f"mesh.{a}={s}" for a, s in sizes.items() if s not in (-1, 1)) or "1"
    if fill:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh.{fill[0]}=-1 cannot fill {num_devices} device{'s' if num_devices > 1 else ''}: the other "
                f"axes multiply to {fixed} ({others}), which does not divide {num_devices}; "
                f"{mesh_advice(sizes, num_devices)}"
            )
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"{' * '.join(f'mesh.{a}' for a in sizes)} = {' * '.join(str(v) for v in sizes.values())} = {fixed} but "
            f"there {'are' if num_devices > 1 else 'is'} {num_devices} device{'s' if num_devices > 1 else ''}; "
            f"{mesh_advice(sizes, num_devices)}"
        )
    return sizes
