"""Whole-file writes that are either complete or absent: temporary name, flush, fsync, rename."""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Callable


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path`` and rename it over ``path`` when done.

    On any error the temporary file is removed and an existing ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_torch_save(obj, path: Path) -> None:
    import torch  # here, so that command-line tools that never save tensors start fast

    atomic_write(path, lambda f: torch.save(obj, f))


class AppendFile:
    """A file that grows by whole appends (a JSON-lines log): each :meth:`append` reaches the file
    whole, or on an error (a full disk) the file is cut back to its length before it, so that no
    torn line is left after the ones already written. Unbuffered: what returns is in the file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "ab", buffering=0)

    def append(self, text: str) -> None:
        data = memoryview(text.encode("utf-8"))
        size = os.fstat(self._f.fileno()).st_size
        try:
            while data:
                data = data[self._f.write(data):]
        except BaseException:
            try:
                os.ftruncate(self._f.fileno(), size)
            except OSError:
                pass
            raise

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
