"""Which code a run is: a digest of the package's own source files.

Two ranks of one job, or a checkpoint and the run resuming from it, ran the same code when their
digests are equal. The package's version number does not tell (it is not raised per commit); the
digest does, whatever the install (a checkout on the path, pip install -e, a wheel).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

#: the package's folder (``fedcp_dist/``, the parent of this module's ``rundir/``): every layer's
#: source counts, the algorithms and the engine above all
PACKAGE = Path(__file__).resolve().parent.parent


def sources() -> list:
    """The ``.py`` files the digest covers, in path order."""
    return sorted(PACKAGE.rglob("*.py"))


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """16 hex digits of the SHA-256 over the package's ``.py`` files (their paths and contents), in
    path order."""
    h = hashlib.sha256()
    for path in sources():
        h.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def code_note(recorded) -> str:
    """The resume's note when the checkpoint was written by other code ("" when by this code):
    its rounds were trained by that code and the rest will be by this, so the run is neither
    version's uninterrupted run; checkpoints from before digests were recorded say so."""
    if recorded == code_digest():
        return ""
    by = f"other fedcp_dist code (source digest {recorded})" if recorded else "fedcp_dist code that recorded no digest"
    return (f"note: the checkpoint was written by {by}, this is {code_digest()}: its rounds were trained by that code "
            f"and the rest will be by this one, so the run is not bit for bit what either would make alone")
