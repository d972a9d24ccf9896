"""Client states on local disk (``client_state: disk``): one file per client, read ahead of use and
written back in the background, the folder held by a lock; and :func:`make_store`, the run's
choice of store (``client_state``: device, host, disk or auto).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import pickle
import shutil
import socket
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Optional

import torch

from fedcp_dist.errors import RunFailure, UserError, first_line
from fedcp_dist.fileio import atomic_torch_save, file_sha256, folders_to_make
from fedcp_dist.state.client_store import (ClientFiles, ClientStore, HostClientStore, State, banks_in_files, pack,
                                           resolve_mode, unpack)
from fedcp_dist.state.process_memory import state_bytes

#: clients whose states the disk store reads ahead of the one being used
PREFETCH_DEPTH = 2


class DiskClientStore(ClientStore):
    """Everything a client keeps on local disk, one file per client (``client_{id}.pt`` in
    ``directory``), each written atomically (temporary name, rename): its state, its own BatchNorm
    running statistics and its compression residual, in the checkpoint's layout (the last two under
    ``__bn__/`` and ``__ef__/``). A client with nothing kept yet has no file: its state is the
    method's initial one, made again when asked for (``init_client_state`` is the same every time).
    In memory are only the entries in flight: those read ahead of their use (:meth:`prefetch`), the
    last few used (``RECENT``) and those written back in the background; :meth:`flush` waits for
    the writes. So a rank's memory grows with its number of clients by the SHA-256 kept for each
    client's file (about 150 bytes a client with its dict entry: 15 MB for 10^5), not by their states.

    The store holds ``directory`` for its life (an exclusive ``flock`` on its ``.lock`` file, which
    names the holder's host and pid; :meth:`close` releases it): a second store on the same
    directory is refused before it removes anything. The files found there at start are an earlier
    attempt's and are removed (a resumed run takes its clients' states from the checkpoint). A file
    that cannot be written or read is a :class:`~fedcp_dist.errors.RunFailure` naming it, and no
    temporary file is left behind."""

    #: entries of the clients used last, kept to serve activate/get/residual of one client by one read
    RECENT = 4
    #: the lock file in the store's directory
    LOCK = ".lock"

    def __init__(self, algo, global_state: State, bn_keys=(), directory: str = "", device="cpu", run: str = ""):
        self.dir = Path(directory)
        self.device = torch.device(device)
        self._made = folders_to_make(self.dir)  # for a start refused after the store was opened
        self._lock = lock_dir(self.dir, run)
        try:
            for old in self.dir.glob("*client_*.pt*"):  # states of an earlier attempt: checkpoints rule
                old.unlink()
        except OSError as exc:
            self._lock.close()
            raise UserError(f"client_state_dir {self.dir} cannot be cleared: {exc.strerror or exc}") from None
        self.saved: set = set()  # clients with a file
        self.changed: set = set()  # clients whose file was written since the last checkpoint
        #: SHA-256 of what this store wrote in each client's file: a read (and a checkpoint's copy)
        #: checks the file against it, so that a file changed on disk since is never trained on
        self._digest: Dict[int, bytes] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="client-state")
        self._writing: Dict[int, tuple] = {}  # client -> (entry, future) until its file is written
        self._older: list = []  # futures of writes overtaken by a later write of the same client
        self._ahead: Dict[int, object] = {}  # client -> future of its read
        self._recent: "OrderedDict[int, State]" = OrderedDict()
        self._order: list = []
        self._pos: Dict[int, int] = {}
        #: global tensors with a row per client (FedAMP's and FedFomo's banks) mapped from files here
        self.mapped_keys = tuple(getattr(algo, "bank_keys", ())) if banks_in_files("disk", self.device) else ()
        self._mapped: Dict[str, torch.Tensor] = {}
        #: SHA-256 of each row of each mapped bank as the run last wrote it, and the file's inode: a
        #: bank file changed on disk since (a flipped bit, a truncation) is named by :meth:`bank_problem`
        self._rows: Dict[str, list] = {}
        self._inode: Dict[str, int] = {}
        super().__init__(algo, global_state, bn_keys)

    def set_global(self, global_state: State) -> None:
        """As :meth:`ClientStore.set_global`; the method's per-client banks (``bank_keys``) are kept
        in files of this directory mapped into memory (``global_{key}.f32``): the page cache holds
        what is used, the kernel may drop it, and the process's own memory does not grow with N."""
        for key in self.mapped_keys:
            if key in global_state and global_state[key] is not self._mapped.get(key):
                global_state[key] = self._map(key, global_state[key])
            elif key in self._mapped:  # updated in place: the peer exchange writes the rows it marks fresh
                fresh = global_state.get("fresh")
                rows = (range(self._mapped[key].shape[0]) if fresh is None
                        else torch.nonzero(fresh).flatten().tolist())
                self._note_rows(key, rows)
        super().set_global(global_state)

    def _row_bytes(self, key: str, i: int) -> bytes:
        row = self._mapped[key].reshape(self._mapped[key].shape[0], -1)[i]
        return hashlib.sha256(row.numpy().view("uint8").data).digest()

    def _note_rows(self, key: str, rows) -> None:
        digests = self._rows.setdefault(key, [b""] * self._mapped[key].shape[0])
        for i in rows:
            digests[i] = self._row_bytes(key, i)

    def _bank_damage(self, rows=None) -> Optional[tuple]:
        """(key, file, what is wrong) for the first mapped bank file that changed on disk since the run
        last wrote it (in ``rows``, or in any row); None when every one holds the run's bytes (each
        row's SHA-256; the file's size first, as a read past a truncated mapping would end the
        process with SIGBUS)."""
        cut = self._bank_cut()
        if cut is not None:
            return cut
        for key in self._mapped:
            path = self.dir / f"global_{key}.f32"
            digests = self._rows.get(key, [])
            bad = next((i for i in (range(len(digests)) if rows is None else rows)
                        if self._row_bytes(key, i) != digests[i]), None)
            if bad is not None:
                return key, path, f"row {bad} is not what the run wrote there"
        return None

    def _bank_cut(self) -> Optional[tuple]:
        """(key, file, what is wrong) for the first mapped bank file cut shorter on disk than the run
        wrote it (a read past the end of its mapping would end the process with SIGBUS), else None."""
        for key, t in self._mapped.items():
            path = self.dir / f"global_{key}.f32"
            try:
                st = path.stat()
            except OSError:  # removed: the mapping still holds the run's bytes
                continue
            if st.st_ino == self._inode.get(key) and st.st_size < t.numel() * 4:
                return key, path, f"cut to {st.st_size} of its {t.numel() * 4} bytes"
        return None

    def bank_problem(self, rows=None) -> Optional[str]:
        """None, or one line naming a per-client bank file (FedAMP's, FedFomo's) that changed on disk
        since the run wrote it (another process, a flipped bit): the rounds since the last checkpoint
        may have read it. Checked for the rows the peer exchange is about to replace (``rows``), and
        whole before a checkpoint copies the banks and before the final files."""
        damage = self._bank_damage(rows)
        if damage is None:
            return None
        key, path, why = damage
        return (f"{self.algo.name}'s per-client {key} in {path} changed on disk since the run wrote it ({why}), and "
                f"the rounds since the last checkpoint read it: run the same command again to resume from the newest "
                f"checkpoint")

    def _check_banks(self) -> None:
        damage = self._bank_damage()
        if damage is not None:
            key, path, why = damage
            raise OSError(errno.EIO, f"{self.algo.name}'s per-client {key} changed on disk since the run wrote it "
                                     f"({why})", str(path))

    def _map(self, key: str, src: torch.Tensor) -> torch.Tensor:
        """``src`` copied into a file-backed tensor of the same shape (rows of zeros are not written).
        The file's blocks are reserved first (``posix_fallocate``): a store in memory pages the
        file system cannot back would end the process with SIGBUS at the first write there, so a
        disk too small is a one-line error here, before training. Rows are copied a few at a time,
        so ``src`` may itself be mapped."""
        path = self.dir / f"global_{key}.f32"
        self._mapped.pop(key, None)
        size = src.numel() * 4
        try:
            with open(path, "wb") as f:
                if size:
                    os.posix_fallocate(f.fileno(), 0, size)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise RunFailure(f"cannot reserve {size / 2**20:.1f} MiB for {self.algo.name}'s per-client {key} in {path} "
                             f"({exc.strerror or exc}): the disk client store needs the room for it (client_state_dir "
                             f"chooses the folder)") from None
        out = torch.from_file(str(path), shared=True, size=src.numel(), dtype=torch.float32).view(src.shape)
        rows = src.reshape(src.shape[0], -1) if src.dim() else src.reshape(1, 1)
        dst = out.reshape(rows.shape)
        step = max(1, (4 << 20) // max(1, rows.shape[1] * 4))
        for i in range(0, rows.shape[0], step):
            chunk = rows[i:i + step]
            if bool(chunk.any()):
                dst[i:i + step] = chunk
        self._mapped[key] = out
        self._inode[key] = path.stat().st_ino
        self._rows.pop(key, None)
        self._note_rows(key, range(out.shape[0]))
        return out

    def _path(self, cid: int) -> Path:
        return self.dir / f"client_{cid:07d}.pt"

    def _read(self, cid: int) -> State:
        path = self._path(cid)
        resume = ("the run's newest checkpoint holds every client's state: run the same command again to resume "
                  "from it")
        try:
            expected = self._digest.get(cid)
            if expected is not None and file_sha256(path).digest() != expected:  # a flipped bit that torch's reader takes
                raise RunFailure(f"cannot read the client state file {path}: it is damaged (its bytes are not what "
                                 f"the run wrote there: changed on disk since); {resume}")
            return torch.load(path, map_location=self.device, weights_only=True)
        except OSError as exc:
            raise RunFailure(f"cannot read the client state file {path}: {exc.strerror or exc}") from None
        except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # torch's reader on a cut or garbled file
            first = first_line(exc, 160)
            raise RunFailure(f"cannot read the client state file {path}: it is damaged ({first}); {resume}") from None

    def _write(self, cid: int, state: State) -> None:
        """Client ``cid``'s file, written whole under a temporary name and renamed (not synced: the files
        are this run's working space, not its record), its SHA-256 kept for the reads and the
        checkpoints' copies; on an error the temporary file is removed, an earlier file stays as it
        was, and a RunFailure names the file."""
        path = self._path(cid)
        self._digest.pop(cid, None)
        try:
            atomic_torch_save({k: v.detach().cpu() for k, v in state.items()}, path, durable=False)
            self._digest[cid] = file_sha256(path).digest()  # read back from the page cache
        except OSError as exc:
            raise RunFailure(f"cannot write the client state file {path}: {exc.strerror or exc}") from None

    def prefetch(self, order) -> None:
        """Clients are about to be used in this order: each use reads the next ones ahead.
        The writes of the last use finish first, so that no state is trained on while it is written.
        A bank file cut short on disk is named here, before a read past its end ends the process
        with SIGBUS (only its size is looked at; its rows at the peer exchange and the checkpoints)."""
        self.flush()
        cut = self._bank_cut()
        if cut is not None:
            key, path, why = cut
            raise RunFailure(f"{self.algo.name}'s per-client {key} in {path} was {why} on disk since the run wrote "
                             f"it: run the same command again to resume from the newest checkpoint")
        self._order = [int(c) for c in order]
        self._pos = {c: i for i, c in enumerate(self._order)}
        for c in self._order[:PREFETCH_DEPTH]:
            self._schedule(c)

    def _schedule(self, cid: int) -> None:
        if cid in self.saved and cid not in self._writing and cid not in self._ahead and cid not in self._recent:
            self._ahead[cid] = self._io.submit(self._read, cid)

    def _entry(self, cid: int) -> Optional[State]:
        """Client ``cid``'s whole kept entry (prefixed as in a checkpoint); None when it has no file."""
        if cid in self._writing:
            return self._writing[cid][0]
        if cid in self._recent:
            self._recent.move_to_end(cid)
            return self._recent[cid]
        i = self._pos.get(cid)
        if i is not None:
            for c in self._order[i + 1:i + 1 + PREFETCH_DEPTH]:
                self._schedule(c)
        pending = self._ahead.pop(cid, None)
        if pending is not None:
            entry = pending.result()
        elif cid in self.saved:
            entry = self._read(cid)
        else:
            return None
        self._recent[cid] = entry
        while len(self._recent) > self.RECENT:
            self._recent.popitem(last=False)
        return entry

    def _keep(self, cid: int, entry: State) -> None:
        """Write ``entry`` back as client ``cid``'s file (in the background)."""
        self._recent.pop(cid, None)
        stale = self._ahead.pop(cid, None)
        if stale is not None:
            stale.result()
        self._reap()
        if cid in self._writing:
            self._older.append(self._writing[cid][1])
        self._writing[cid] = (entry, self._io.submit(self._write, cid, entry))
        self.saved.add(cid)
        self.changed.add(cid)

    def activate(self, cid: int) -> Optional[State]:
        if self.bn_keys:
            own = unpack(self._entry(cid) or {})[0]
            self.algo.set_global({**self.global_state, **own} if own else self.global_state)
        return self.get(cid)

    def get(self, cid: int) -> Optional[State]:
        rest = unpack(self._entry(cid) or {})[2]
        return rest if rest else self.algo.init_client_state(cid)

    def peek(self, cid: int) -> Optional[State]:
        return (unpack(self._entry(cid) or {})[2] or None) if cid in self.saved else None

    def put(self, cid: int, state: Optional[State], upload: State, residual: Optional[State] = None) -> None:
        if state is None and residual is None and not self.bn_keys:
            return
        bn, ef, rest = unpack(self._entry(cid) or {})
        if self.bn_keys:  # a part not uploaded this round (a frozen CPN's) keeps its statistics
            bn = {**bn, **{k: upload.pop(k) for k in self.bn_keys if k in upload}}
        self._keep(cid, pack(state if state is not None else rest, bn, residual if residual is not None else ef))

    def residual(self, cid: int) -> Optional[State]:
        return unpack(self._entry(cid) or {})[1] or None

    def _reap(self) -> None:
        for c in [c for c, (_, f) in self._writing.items() if f.done()]:
            self._writing.pop(c)[1].result()  # raises a failed write here
        while self._older and self._older[0].done():
            self._older.pop(0).result()

    def flush(self) -> None:
        """Wait for every write back; drop reads ahead that were not used. Every pending read and
        write has ended when it returns or raises (the first failure)."""
        pending = [*self._older, *(f for _, f in self._writing.values()), *self._ahead.values()]
        self._older, self._writing, self._ahead = [], {}, {}
        self._order, self._pos = [], {}
        first = None
        for f in pending:
            try:
                f.result()
            except BaseException as exc:  # the others still end before this one is raised
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for the writes, then release the directory (also after a failed write, whose
        error is raised once the lock is released)."""
        if self._lock is None:
            return
        try:
            self.flush()
        finally:
            self._io.shutdown(wait=True)
            for tmp in self.dir.glob(".client_*.pt.tmp*"):  # none is being written any more
                tmp.unlink(missing_ok=True)
            self._lock.close()
            self._lock = None

    def unmake(self) -> None:
        """After :meth:`close`, for a start refused once the store was opened (a resume that the
        checkpoint's config refuses): the folders the store made go again when they hold nothing
        but its lock file (an earlier attempt's folder, or one with files, stays as it was)."""
        if not self._made or self._lock is not None:
            return
        try:
            if [p.name for p in self.dir.iterdir()] != [self.LOCK]:
                return
            (self.dir / self.LOCK).unlink()
            for folder in self._made:
                folder.rmdir()  # not empty (another rank's folder beside it, say): it stays
        except OSError:
            pass
        # the run's own folder above the ranks' (client_state/, or <run>-<digest>/ under
        # client_state_dir; no other run's): the last rank to leave removes it, whichever made it
        try:
            self.dir.parent.rmdir()
        except OSError:  # gone already, or another rank's folder still in it
            pass

    def held_bytes(self) -> int:
        return (super().held_bytes() + sum(state_bytes(e) for e, _ in self._writing.values())
                + sum(state_bytes(e) for e in self._recent.values()))

    def state_dict(self) -> Dict[int, State]:
        """As :meth:`ClientStore.state_dict`: the clients' files mapped into memory (read from disk
        as they are used, not held at once); they are already in its layout. Checkpoints take the
        files themselves (:meth:`checkpoint_part`)."""
        self.flush()
        self._recent.clear()
        return {c: torch.load(self._path(c), map_location="cpu", weights_only=True, mmap=True) for c in self.saved}

    def checkpoint_part(self) -> ClientFiles:
        """The clients' files, once every write has ended, and those written since the last
        checkpoint (or the one resumed from: :meth:`load_state_dict` writes states that are already
        in it, so they do not count as changed): a checkpoint writes only those."""
        self.flush()
        changed = set(self.changed)
        # every client's digest, not only the changed ones': an unchanged client is copied too where
        # there is no previous checkpoint's file to link (a resume from another client_state)
        return ClientFiles({c: self._path(c) for c in sorted(self.saved)}, changed,
                           lambda: self.changed.difference_update(changed), self._digest,
                           self._check_banks)

    def load_state_dict(self, states: Dict[int, State]) -> None:
        """Write the checkpointed states as the clients' files (not counted as changed)."""
        self._recent.clear()
        for c, state in states.items():
            if state:
                self._write(c, dict(state))
                self.saved.add(c)


def lock_dir(directory: Path, run: str = ""):
    """Create ``directory`` and take an exclusive, non-blocking ``flock`` on its lock file, which
    then names the holder (host, pid and ``run``); returns the open lock file (closing it releases
    the lock, and so does the process ending). A directory held by another process (or another
    store of this one) is a one-line UserError naming it and its holder."""
    path = directory / DiskClientStore.LOCK
    try:
        directory.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"client_state_dir {directory} cannot be written: {exc.strerror or exc}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if not isinstance(exc, BlockingIOError):  # e.g. a file system without locks
            f.close()
            raise UserError(f"client_state_dir {directory} cannot be locked ({path}): {exc.strerror or exc}; "
                            f"use a local disk") from None
        f.seek(0)
        holder = " ".join(f.read().split()) or "a process that did not say who it is"
        f.close()
        raise UserError(f"client_state_dir {directory} is in use by another run ({holder}); give each run its own "
                        f"client_state_dir, or wait for that run to end") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()} pid {os.getpid()}" + (f" {run}" if run else "") + "\n")
        f.flush()
    except OSError as exc:
        f.close()
        raise UserError(f"client_state_dir {directory} cannot be written: {exc.strerror or exc}") from None
    return f


def run_state_dir(out_dir: str, client_state_dir: str, rank: int) -> Path:
    """Rank ``rank``'s folder of a disk store: ``out_dir/client_state/rank_{r}``, or with
    ``client_state_dir`` set, ``client_state_dir/{run}/rank_{r}`` where ``{run}`` is out_dir's name
    and a hash of its absolute path. So runs that share a scratch disk never share a folder, and a
    requeued run (the same out_dir) finds its own again."""
    if not client_state_dir:
        return Path(out_dir) / "client_state" / f"rank_{rank}"
    resolved = Path(out_dir).resolve()
    digest = hashlib.sha256(str(resolved).encode("utf-8")).hexdigest()[:16]
    return Path(client_state_dir) / f"{resolved.name[:100]}-{digest}" / f"rank_{rank}"

def prune_stale_ranks(folder: Path, world_size: int) -> list:
    """The ``rank_{k}`` folders in ``folder`` (a run's, :func:`run_state_dir`'s parent) of ranks
    this run does not have (k >= ``world_size``: an earlier attempt on more ranks, whose states the
    checkpoint holds), removed where no process holds their lock; the ranks removed. Nothing
    else owned or cleaned them: a run resumed on fewer ranks left their files behind."""
    removed = []
    for d in sorted(folder.glob("rank_*")) if folder.is_dir() else []:
        k = d.name[len("rank_"):]
        if not k.isdigit() or int(k) < world_size or d.is_symlink() or not d.is_dir():
            continue
        try:
            f = open(d / DiskClientStore.LOCK, "a+", encoding="utf-8")
        except OSError:
            continue
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live process: left to it
            shutil.rmtree(d)
            removed.append(int(k))
        except OSError:
            pass
        finally:
            f.close()
    return removed


def make_store(cfg, algo, global_state: State, owned, device, rank: int,
               world_size: int = 1) -> tuple[ClientStore, str]:
    """The run's client-state store (``client_state``) and a few words for the start line. Rank 0
    of a disk store removes the folders of ranks the run no longer has (:func:`prune_stale_ranks`)."""
    bn_keys = ClientStore.for_run(algo, global_state, cfg.aggregate_bn_stats).bn_keys
    per_client = state_bytes(algo.init_client_state(int(owned[0]))) if len(owned) else 0
    mode, why = resolve_mode(cfg.client_state, per_client, len(owned), cfg.client_state_budget_mb, device)
    if mode == "disk":
        store = DiskClientStore(algo, global_state, bn_keys, run_state_dir(cfg.out_dir, cfg.client_state_dir, rank),
                                device, run=f"out_dir {Path(cfg.out_dir).resolve()} rank {rank}")
        where = f"disk ({store.dir})"
        gone = prune_stale_ranks(store.dir.parent, world_size) if rank == 0 else []
        if gone:
            where += (f"; removed the folder{'s' if len(gone) > 1 else ''} of rank{'s' if len(gone) > 1 else ''} "
                      f"{', '.join(map(str, gone))} left by an attempt on more ranks")
    elif mode == "host":
        store, where = HostClientStore(algo, global_state, bn_keys, device), "host"
    else:
        store, where = ClientStore(algo, global_state, bn_keys), "device"
    return store, f"client states: {where}" + (f" [{why}]" if why != "client_state" else "")

