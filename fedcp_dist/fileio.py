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
