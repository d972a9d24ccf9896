"""Whole-file writes that are either complete or absent: temporary name, flush, fsync, rename."""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import socket
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterator

from fedcp_dist import interrupts

#: this host's name, in temporary file names: a leftover is removed only by a process of its host
_HOST = socket.gethostname().replace("/", "_") or "host"


@contextlib.contextmanager
def atomic_path(path, durable: bool = True, replace: bool = True, orphans: bool = False) -> Iterator[Path]:
    """Yield a temporary name beside ``path`` to write the file under; when the block ends without
    error the file is synced to disk (``durable``) and renamed over ``path``. With ``replace``
    false a ``path`` that appeared meanwhile (another process wrote it) is not replaced: the
    temporary file is linked to ``path``, which fails when it exists (FileExistsError).

    On any error the temporary file is removed and an existing ``path`` is left as it was. With
    ``orphans`` (a large file written rarely, such as a shard), the temporary files that killed
    writers of this host left beside ``path`` are removed first.
    """
    path = Path(path)
    tmp = path.with_name(f"{_tmp_prefix(path)}{os.getpid()}")
    if orphans:
        _remove_orphans(path)
    try:
        yield tmp
        interrupts.check()  # a stop signal swallowed while the file was written: not published
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _publish_new(tmp: Path, path: Path) -> None:
    """``tmp`` renamed to ``path`` unless ``path`` exists (FileExistsError): a hard link, which
    never replaces; where the file system has none, a check then a rename (a narrow race)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some FUSE and object-store mounts)
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


#: the longest file name most file systems take (ext4, XFS, Lustre, GPFS: 255 bytes)
NAME_MAX = 255


def _tmp_prefix(path: Path) -> str:
    """``.NAME.tmp-HOST-`` (a pid follows): the temporary names of :func:`atomic_path`. A name near
    the file system's limit is cut, with a digest of the whole name to keep it apart, so that any
    name that can be written can be written atomically."""
    host = _HOST[:64]
    prefix = f".{path.name}.tmp-{host}-"
    if len(prefix.encode("utf-8", "surrogateescape")) + 10 <= NAME_MAX:  # 10: the pid's digits
        return prefix
    name = path.name.encode("utf-8", "surrogateescape")
    digest = hashlib.sha256(name).hexdigest()[:12]
    keep = NAME_MAX - 10 - len(f".~{digest}.tmp-{host}-".encode())
    return f".{name[:max(0, keep)].decode('utf-8', 'ignore')}~{digest}.tmp-{host}-"


def _remove_orphans(path: Path) -> None:
    """Remove the ``.NAME.tmp-HOST-PID`` files beside ``path`` that a process of this host left and
    that no longer runs (a writer killed by SIGKILL or the OOM killer cannot remove its own; at a
    million clients a shard's is GBs). Another host's are left: its writer may still be at work on
    a shared file system."""
    prefix = _tmp_prefix(path)
    try:
        entries = list(path.parent.glob(f"{glob.escape(prefix)}*"))
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(prefix):]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                entry.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], durable: bool = True) -> None:
    """Call ``write(f)`` on a temporary file beside ``path`` and rename it over ``path`` when done
    (:func:`atomic_path`)."""
    with atomic_path(path, durable) as tmp:
        try:
            with open(tmp, "wb") as f:
                write(f)
        except OSError as exc:  # a full disk fails the buffered flush at close, an error with no file name
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def os_error_behind(exc: BaseException):
    """The OSError that ``exc`` was raised from or while handling (torch's zip writer turns a full
    disk into a RuntimeError raised while handling the OSError), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def atomic_torch_save(obj, path: Path, durable: bool = True) -> None:
    """``torch.save`` of ``obj`` to ``path``, whole or not at all (:func:`atomic_write`); a write that
    fails for the file system's reason (a full disk, a file size limit) is an OSError naming ``path``,
    whichever error torch's writer raised for it."""
    import torch  # here, so that command-line tools that never save tensors start fast

    def write(f) -> None:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:
            err = os_error_behind(exc)
            if err is None:
                raise
            raise OSError(err.errno, err.strerror or str(err), str(path)) from exc

    atomic_write(path, write, durable)


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

    def still_there(self) -> bool:
        """Whether the file appended to is still the one at its path (not removed, with its folder or
        alone, nor replaced by another file)."""
        return self._f is None or same_file(self._f.fileno(), self.path)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def same_file(fd: int, path) -> bool:
    """Whether the open file ``fd`` is the file at ``path``: not unlinked (alone or with its folder),
    and ``path`` not another file meanwhile."""
    try:
        held = os.fstat(fd)
        st = os.stat(path)
    except OSError:
        return False
    return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino)


def folder_above_problem(path) -> str:
    """Why ``path`` cannot be made ("" when it can, as far as can be told before writing): the
    nearest existing folder above it is a file, or cannot be written in. Missing folders between
    are made by the writer."""
    above = Path(path).resolve().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        return f"{above} is a file, not a folder"
    problem = cannot_write_in(above)
    return f"cannot write in {above}: {problem}" if problem else ""


def cannot_write_in(folder) -> str:
    """Why nothing can be written in the existing ``folder`` ("" when a file can): a file is made
    and removed there, which also finds what permission bits do not tell root (an immutable
    folder, a read-only mount)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".write-check-")
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(name)
    return ""


def file_sha256(path) -> "hashlib._Hash":
    """The SHA-256 of the bytes of the file at ``path``, read 1 MiB at a time (``.digest()`` or
    ``.hexdigest()`` of it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h


def folders_to_make(folder) -> list:
    """The folders a ``mkdir -p`` of ``folder`` would make: ``folder`` and each folder above it
    that does not exist yet, the innermost first (taken before, for undoing a start refused after)."""
    made, p = [], Path(folder).absolute()
    while not os.path.lexists(p) and p != p.parent:
        made.append(p)
        p = p.parent
    return made
