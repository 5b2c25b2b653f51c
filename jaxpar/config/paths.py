"""The paths a command reads and writes: what is wrong with one, said once for every command, and files written
whole or not at all. No jax.

  directory_problem(path)    why `path` is not a directory to read (missing, a file), or None
  output_dir_problem(path)   why `path` cannot be the directory a command writes into (a file in the way, no
                             permission to create or write it, a read-only file system), or None; checked before
                             any work, so a command refuses at once instead of failing after it
  write_atomic(path, data)   a temporary file beside `path` renamed over it: a kill mid-write leaves the old file
                             (or none), never half of the new one

Each caller turns a problem into its own error, naming the path, the problem and its fix, e.g. "--out 'runs/x'
cannot be created: runs is a file, not a directory; give a directory you can write".
"""

from __future__ import annotations

import os
import secrets
import tempfile


def directory_problem(path: str) -> str | None:
    """Why `path` is not an existing directory ("does not exist", "is a file, not a directory"), else None."""
    if os.path.isdir(path):
        return None
    return "is a file, not a directory" if os.path.exists(path) else "does not exist"


def output_dir_problem(path: str, *, keep_created: bool = False) -> str | None:
    """Why `path` cannot be a directory this process creates (with its parents) and writes files in, else None:
    "is a file", "cannot be created: P is a file, not a directory", "is not writable" (no permission, or a
    read-only file system), or "cannot be created or written (STRERROR: FILE)". Probes by creating what is
    missing and a temporary file in it, then removes both unless `keep_created` (a multi-process run's
    processes probe at once: one removing a directory another is probing would fail that one).
    """
    absolute = os.path.abspath(path)
    missing, probe = [], absolute
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        missing.append(probe)
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return "is a file" if probe == absolute else f"cannot be created: {probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):  # also a read-only file system (EROFS), even for root
        return "is not writable" if probe == absolute else f"cannot be created: {probe} is not writable"
    try:
        os.makedirs(absolute, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".jaxpar-write-check-", dir=absolute)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        return f"cannot be created or written ({e.strerror}: {e.filename})"
    finally:
        for created in () if keep_created else missing:  # innermost first
            try:
                os.rmdir(created)
            except OSError:
                break
    return None


def write_atomic(path: str, data: str | bytes) -> None:
    """Writes `data` (text as UTF-8) to `path` through a temporary file in the same directory, flushed to disk and
    renamed over `path`: readers see the old file or the whole new one. The temporary file is removed if the
    write fails.

    Raises:
      OSError: the directory cannot be written.
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # mode as the umask says
    try:
        with open(tmp, "xb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
