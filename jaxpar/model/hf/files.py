"""The safetensors file format read by region and written tensor by tensor: the I/O under loading and exporting a
model that no single host holds whole (`jaxpar.model.hf.lazy`, `jaxpar.model.hf.gather`).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, the offsets counted from the end of the header), then every
tensor's bytes, row-major, back to back.

Reads (`TensorFiles.read`) copy one rectangle of a 1-D or 2-D tensor (a list of row ranges by a list of column
ranges) into a new array, by default through safetensors' own `safe_open(...).get_slice(name)[...]` (one open per
read). `backend="pread"` reads the same rectangle with positioned reads (`os.preadv`) instead, one read per run of
contiguous bytes: get_slice maps the file into the process (mmap), and a strided slice faults in every page of the
rows it crosses, which counts in the process's resident memory until the file is closed (clean file pages the
kernel may drop, not the process's own). Measured here (safetensors 0.8.0, Linux): a [32000, 2048] float32 tensor's
62 MiB column slice [:, :512] raised the reading process's RSS by 250 MiB of file pages; on a whole 1B model the two
backends' peaks differ by 1.6 against 1.2 of the largest block (docs/checkpoints.md). Bytes read
(`TensorFiles.bytes_read`) are the rectangle's bytes either way.

Writes (`write_streamed`) put each file's header first (every name, dtype and shape is known ahead), then the
tensors one at a time as they come: the host holds one tensor, not a whole file. Files are split and named as
transformers' save_pretrained does (model.safetensors, or model-0000i-of-0000n.safetensors filled in order, with
model.safetensors.index.json).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import NamedTuple

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxpar.config.paths import write_atomic
from jaxpar.model.hf.config import HFConfigError
from jaxpar.model.hf.weights import INDEX_FILE, SINGLE_FILE, whole_file

STORED_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
_CODES = {dtype.name: code for code, dtype in STORED_DTYPES.items()}  # "bfloat16" -> "BF16"
NUMPY_DTYPES = {dtype.name: dtype for dtype in STORED_DTYPES.values()}  # "bfloat16" -> its numpy dtype
BACKENDS = ("pread", "safetensors")
Ranges = list[tuple[int, int]]  # [start, stop) runs along one axis


class TensorInfo(NamedTuple):
    """Where one tensor lies: its file, dtype, shape and the absolute byte offset of its first element."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Every float tensor of the safetensors file at `path` (F32, BF16, F16; others are left out) from its header.

    Raises:
      HFConfigError: a header that is not safetensors', or a tensor whose byte range does not fit its shape.
    """
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise HFConfigError(f"{path}: not a readable safetensors header ({e}); copy or download it again") from None
    out = {}
    for name, info in header.items():
        dtype = STORED_DTYPES.get(info.get("dtype")) if name != "__metadata__" else None
        if dtype is None:
            continue
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise HFConfigError(f"{path}: {name}'s byte range [{begin}, {end}) does not fit its shape {shape}")
        out[name] = TensorInfo(path, dtype, shape, 8 + n + begin)
    return out


def _pread_into(fd: int, buffer: memoryview, offset: int, path: str) -> None:
    while buffer.nbytes:
        got = os.preadv(fd, [buffer], offset)
        if got == 0:
            raise HFConfigError(f"{path} ends before its tensors do: it is truncated; copy or download it again")
        buffer, offset = buffer[got:], offset + got


class TensorFiles:
    """Rectangles of the tensors of a model's safetensors files (module docstring), counting the bytes read.

    Args:
      files: tensor name -> file path (`jaxpar.model.hf.weights.weight_files`).
      backend: "safetensors" (`get_slice`, the default) or "pread" (positioned reads; module docstring).

    Raises:
      HFConfigError: as `read_header`. ValueError: an unknown backend.
    """

    def __init__(self, files: dict[str, str], backend: str = "safetensors"):
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        self.backend = backend
        self.bytes_read = 0  # bytes of the rectangles read so far, in the stored dtype
        self._info: dict[str, TensorInfo] = {}
        for path in sorted(set(files.values())):
            self._info.update({n: i for n, i in read_header(path).items() if files.get(n) == path})
        self._fds: dict[str, int] = {}

    def info(self, name: str) -> TensorInfo:
        """The tensor's file, dtype, shape and offset. Raises KeyError: no float tensor of that name."""
        return self._info[name]

    def read(self, name: str, rows: Ranges, cols: Ranges | None = None) -> np.ndarray:
        """The rows `rows` (of a 1-D tensor: its elements) by the columns `cols` (2-D only; None: all) of tensor
        `name`, concatenated in the order given: [sum of row runs] or [sum of row runs, sum of column runs], in the
        stored dtype.

        Raises:
          HFConfigError: the file ends early. ValueError: ranges outside the tensor's shape.
        """
        info = self._info[name]
        width = info.shape[1] if len(info.shape) == 2 else 1
        cols = [(0, width)] if cols is None else cols
        for (a, b), size in [(r, info.shape[0]) for r in rows] + [(c, width) for c in cols]:
            if not 0 <= a <= b <= size:
                raise ValueError(f"{name}: range [{a}, {b}) outside its shape {info.shape}")
        n_rows, n_cols = sum(b - a for a, b in rows), sum(b - a for a, b in cols)
        shape = (n_rows,) if len(info.shape) == 1 else (n_rows, n_cols)
        self.bytes_read += n_rows * n_cols * info.dtype.itemsize
        if self.backend == "safetensors":
            return self._read_mapped(name, info, rows, cols).reshape(shape)
        raw = np.empty(n_rows * n_cols * info.dtype.itemsize, np.uint8)
        out, pos, item = raw.data, 0, info.dtype.itemsize
        fd = self._fd(info.path)
        for a, b in rows:
            if cols == [(0, width)]:  # whole rows: one run
                size = (b - a) * width * item
                _pread_into(fd, out[pos : pos + size], info.offset + a * width * item, info.path)
                pos += size
                continue
            for r in range(a, b):
                for c, d in cols:
                    size = (d - c) * item
                    _pread_into(fd, out[pos : pos + size], info.offset + (r * width + c) * item, info.path)
                    pos += size
        return raw.view(info.dtype).reshape(shape)

    def _read_mapped(self, name: str, info: TensorInfo, rows: Ranges, cols: Ranges) -> np.ndarray:
        with safe_open(info.path, "numpy") as f:  # closed (unmapped) after each read
            view = f.get_slice(name)
            if len(info.shape) == 1:
                return np.concatenate([view[a:b] for a, b in rows])
            return np.block([[view[a:b, c:d] for c, d in cols] for a, b in rows])

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        """Closes the files (reads after this reopen them)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan_files(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names (in `sizes`' order) per file: filled in order, a new file once the next tensor would take the
    current one past `max_shard_bytes` (a tensor larger than that gets a file of its own)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) * NUMPY_DTYPES[dtype].itemsize


def _header(specs: dict[str, tuple[str, tuple[int, ...]]]) -> bytes:
    entries: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in specs.items():
        nbytes = _nbytes(dtype, shape)
        entries[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def _write_file(path: str, specs: dict[str, tuple[str, tuple[int, ...]]], tensors: Iterator[np.ndarray]) -> None:
    """One safetensors file, whole or not at all (`jaxpar.model.hf.weights.whole_file`)."""
    with whole_file(path) as partial, open(partial, "wb") as f:
        f.write(_header(specs))
        for name, (dtype, shape) in specs.items():
            w = next(tensors)
            if w.dtype.name != dtype or w.shape != shape:
                raise HFConfigError(f"{name}: got {w.dtype.name} {w.shape} to write, its header says {dtype} {shape}")
            f.write(np.ascontiguousarray(w).reshape(-1).view(np.uint8).data)
            del w  # before the next one is made


def file_layout(specs: dict[str, tuple[str, tuple[int, ...]]], max_shard_bytes: int) -> dict[str, list[str]]:
    """File name -> the tensor names it holds, as `write_streamed` lays `specs` out (`plan_files`)."""
    groups = plan_files({name: _nbytes(dtype, shape) for name, (dtype, shape) in specs.items()}, max_shard_bytes)
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": group for i, group in enumerate(groups)}


def write_streamed(
    out_dir: str,
    specs: dict[str, tuple[str, tuple[int, ...]]],
    tensors: Iterator[np.ndarray],
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Writes tensors as they come into `out_dir`: model.safetensors, or above `max_shard_bytes` per file
    model-0000i-of-0000n.safetensors (`file_layout`) with model.safetensors.index.json (metadata {"format": "pt"}).

    Args:
      specs: name -> (dtype name: "float32", "bfloat16" or "float16", shape), in the order the tensors come.
      tensors: one numpy array per spec, in order, each of its spec's dtype and shape.

    Returns:
      The file names written.

    Raises:
      HFConfigError: a tensor unlike its spec (its file is not left behind).
    """
    layout = file_layout(specs, max_shard_bytes)
    os.makedirs(out_dir, exist_ok=True)
    for file, group in layout.items():
        _write_file(os.path.join(out_dir, file), {n: specs[n] for n in group}, tensors)
    if len(layout) == 1:
        return list(layout)
    index = {
        "metadata": {"total_size": sum(_nbytes(*specs[n]) for n in specs)},
        "weight_map": {n: file for file, group in layout.items() for n in group},
    }
    write_atomic(os.path.join(out_dir, INDEX_FILE), json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*layout, INDEX_FILE]
