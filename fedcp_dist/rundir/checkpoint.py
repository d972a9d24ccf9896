"""Round-R checkpoints: written atomically, complete only when every part is, the last k kept.

Layout of ``out_dir/checkpoints/round_{R:07d}/`` (R = rounds trained):

* ``global.pt``        rank 0: the global state, R, and the run's metadata as JSON (the metric
                       records so far, the config and, with ``dp: central``, the clip norm adaptive
                       clipping reached); the random streams need nothing more, since every draw
                       (DP's noise included) derives from (seed, round, client)
* ``clients_{r}.pt``   rank r: the persistent state of the clients it owns, keyed by client id
                       (so a checkpoint can be resumed on another world size)
* ``COMPLETE``         rank 0, after every rank has written its part: the world size and a
                       SHA-256 of every part. A directory without it, or whose parts do not
                       match it, does not count.

With ``client_state: disk`` the clients' states are files of their own instead of
``clients_{r}.pt``, so that a checkpoint writes only what changed since the previous one:

* ``clients/client_{id:07d}.pt``  a client's state, as the store keeps it. A client whose state
                       changed since the previous checkpoint (the one written or resumed from) is
                       a copy of the store's file, synced; any other is a hard link to the
                       previous checkpoint's file: the same bytes, not read or written again (a
                       copy where the file system has no hard links). Removing an older
                       checkpoint removes its names only, never a newer one's files.
* ``clients_{r}.json`` rank r: its clients' files, each with its SHA-256 and size (an unchanged
                       client's carried over from the previous checkpoint); ``COMPLETE`` holds the
                       SHA-256 of these indexes, which so cover every client file. Resuming checks
                       every file's SHA-256; choosing which older checkpoints to keep checks
                       that each file is there with its size.

After each checkpoint the newest ``keep_checkpoints`` verified ones stay: the new one and the
newest older ones whose parts match their checksums; damaged and unfinished ones are removed.

Every file is written to a temporary name, flushed to disk and renamed.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Dict, Iterable, Optional, Union

import torch

from fedcp_dist.data.shards.verify import ShardDigest, describe_differences
from fedcp_dist.errors import RunFailure, UserError
from fedcp_dist.rundir.faults import fault_point
from fedcp_dist.rundir.preemption import interrupt_after
from fedcp_dist.fileio import atomic_torch_save, atomic_write_bytes, file_sha256
from fedcp_dist.rundir.directory import CHECKPOINT_MARKER as MARKER, RunDir, check_resume_config
from fedcp_dist.state.client_store import ClientFiles

#: a disk store's checkpoint: the folder of its clients' files (and the manifest's key naming it)
CLIENT_DIR = "clients"


def _sha256(path: Path) -> str:
    return file_sha256(path).hexdigest()


def data_record(path: str, fingerprint: str, layout: str, digest: Optional[ShardDigest] = None,
                num_clients: Optional[int] = None) -> dict:
    """What a checkpoint records of the shard it was made on (``meta["data"]``): its path, the
    fingerprint written with it ("" for a shard written without one), its layout digest (see
    :mod:`fedcp_dist.data.shards`), its number of clients and, from ``digest`` (what the shard holds,
    hashed when the run started: :func:`~fedcp_dist.data.shards.verify.verify_shard`), its content's
    fingerprint and each array's digest."""
    record = {"path": path, "fingerprint": fingerprint or None, "layout": layout}
    if num_clients is not None:
        record["clients"] = int(num_clients)
    if digest is not None:
        record.update(content=digest.fingerprint, arrays=dict(digest.arrays))
    return record


def check_same_data(recorded: Optional[dict], current: dict, out_dir, echo) -> bool:
    """Refuse to resume the checkpointed run in ``out_dir`` on other data than it was made on (a
    UserError naming what differs). ``current``: this run's :func:`data_record`, with the content
    hashed. True when the content is the checkpointed run's, wherever the shard now lies (a copy of it
    on node-local scratch resumes); False when it could be checked by the layout only (a checkpoint
    of a shard written before fingerprints), said so, or not at all (a checkpoint written before
    runs recorded their shard)."""
    if not isinstance(recorded, dict):
        echo(f"note: the checkpoint in {out_dir} records no shard fingerprint (written by an earlier version); "
             f"the data is not checked against it")
        return False
    refuse = (f"data.path {current.get('path')} holds other data than the checkpointed run in {out_dir} was made "
              f"on: {{}} (partitioned again, or edited in place?); point data.path at the shard the run was made on "
              f"(a copy of it resumes from anywhere), or use another out_dir, or overwrite=true to start afresh")
    if isinstance(recorded.get("clients"), int) and isinstance(current.get("clients"), int) \
            and recorded["clients"] != current["clients"]:
        raise UserError(refuse.format(f"it holds {current['clients']} clients, the checkpointed run's shard "
                                      f"{recorded['clients']}"))
    if isinstance(recorded.get("arrays"), dict) and current.get("arrays"):
        differ = [k for k in sorted(set(recorded["arrays"]) | set(current["arrays"]))
                  if recorded["arrays"].get(k) != current["arrays"].get(k)]
        if differ:
            raise UserError(refuse.format(f"its {describe_differences(differ)} differ from the checkpoint's"))
        return True
    old = recorded.get("content") or recorded.get("fingerprint")  # the latter: as written, verified when read
    new = current.get("content") or current.get("fingerprint")
    if old and new:
        if old != new:
            raise UserError(refuse.format(f"its shard fingerprint is {new[:19]}..., the checkpoint's {old[:19]}..."))
        return True
    if recorded.get("layout") != current.get("layout"):
        raise UserError(refuse.format("its clients' sample or label counts differ"))
    echo("note: the checkpointed run's shard had no content fingerprint (written before shards had one); resuming "
         "checked only its clients' sample and label counts")
    return False


def _check_client_shapes(d: Path, store, client_states: dict) -> None:
    """The checkpointed clients' states against the method's initial client state (one line on a
    tensor of another shape)."""
    if not client_states:
        return
    template = store.algo.init_client_state(next(iter(client_states))) or {}
    for c, state in client_states.items():
        for key, t in state.items():
            want = template.get(key)
            if want is not None and tuple(want.shape) != tuple(t.shape):
                raise UserError(f"checkpoint {d}: client {c}'s tensor '{key}' has shape {list(t.shape)} but this "
                                f"run's is {list(want.shape)} (another model or data?); use another out_dir, "
                                f"or overwrite=true to start afresh")


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` where it names no file or only ``path``'s temporary file."""
    if not exc.filename or Path(str(exc.filename)).name.startswith(f".{path.name}.tmp"):
        exc.filename = str(path)
    return exc


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu() for k, v in state.items()}


def _client_file(cid: int) -> str:
    return f"client_{cid:07d}.pt"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link(src: Path, dst: Path) -> bool:
    """``dst`` made a hard link to ``src``; False where it cannot be (another file system, no such file)."""
    try:
        os.link(src, dst)
        return True
    except OSError:
        return False


def _copy(src: Path, dst: Path) -> list:
    """``src`` copied to ``dst`` and synced; [SHA-256, size] of the bytes copied."""
    h, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for block in iter(lambda: fin.read(1 << 20), b""):
            h.update(block)
            fout.write(block)
            size += len(block)
        fout.flush()
        os.fsync(fout.fileno())
    return [h.hexdigest(), size]


def _client_index(d: Path, manifest: dict) -> Dict[int, list]:
    """{client: [SHA-256, size]} of every rank's ``clients_{r}.json`` in checkpoint ``d``."""
    index: Dict[int, list] = {}
    for r in range(int(manifest["world_size"])):
        index.update({int(c): v for c, v in json.loads((d / f"clients_{r}.json").read_text())["clients"].items()})
    return index


def _manifest_problem(manifest, folder: str) -> str:
    """What is wrong with a COMPLETE marker's fields ("" when nothing): the world size a whole
    number >= 1, a checksum for exactly the parts that world size writes (``global.pt`` and one
    ``clients_{r}`` each, ``.json`` for a disk store's index, ``.pt`` otherwise), the round its
    folder's."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    world_size, sums = manifest.get("world_size"), manifest.get("sha256")
    if type(world_size) is not int or world_size < 1:
        return f"world_size {world_size!r}"
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        return "sha256 is not a map of parts to checksums"
    files = manifest.get("client_files")
    if files not in (None, CLIENT_DIR):
        return f"client_files {files!r}"
    kind = "json" if files else "pt"
    parts = {"global.pt", *(f"clients_{r}.{kind}" for r in range(world_size))}
    if set(sums) != parts:
        return f"its parts {sorted(sums)} are not those of {world_size} rank(s)"
    if "round" in manifest and (type(manifest["round"]) is not int or f"round_{manifest['round']:07d}" != folder):
        return f"round {manifest['round']!r} in folder {folder}"
    return ""


class Checkpointer:
    def __init__(self, out_dir: str, rank: int, world_size: int, keep: int):
        self.run = RunDir(out_dir)
        self.root = self.run.checkpoints
        self.rank = rank
        self.world_size = world_size
        self.keep = max(1, keep)
        #: the checkpoint a disk store's unchanged clients are linked from (the last written or
        #: resumed from) and its {client: [SHA-256, size]}; None: every client counts as changed
        self._base: Optional[tuple[Path, Dict[int, list]]] = None
        #: whether a save may make out_dir: only until the run's start made it (:meth:`out_dir_made`),
        #: so that one removed while the run goes (rm -rf) is never made again, by any rank
        self._make_out_dir = True

    def out_dir_made(self) -> None:
        """The run's out_dir exists (rank 0 made it at start): from now on no save makes it."""
        self._make_out_dir = False

    # -- writing -------------------------------------------------------------
    def save(self, rounds_done: int, global_state: dict, client_states: Union[dict, ClientFiles], meta: dict,
             all_ok) -> Path:
        """Every rank calls this with its own clients (their states, or a disk store's
        :class:`~fedcp_dist.state.client_store.ClientFiles`); returns the checkpoint directory.

        ``all_ok(ok)`` is a collective: True when every rank passes True. A write that fails on
        any rank (a full disk, say) leaves the previous checkpoint as the newest complete one and
        raises :class:`RunFailure` on every rank. A Ctrl-C (SIGINT) meanwhile takes effect once the
        checkpoint is complete (:class:`~fedcp_dist.rundir.preemption.interrupt_after`).
        """
        with interrupt_after():
            return self._save(rounds_done, global_state, client_states, meta, all_ok)

    def _save(self, rounds_done: int, global_state: dict, client_states: Union[dict, ClientFiles], meta: dict,
              all_ok) -> Path:
        d = self.root / f"round_{rounds_done:07d}"
        files = client_states if isinstance(client_states, ClientFiles) else None
        problem = None
        target = d
        made = False  # this round's folder was made here: a write in it that finds it gone met an rm -rf
        vanished = False  # and this rank's own write did (another rank's failure says nothing of the folder)
        index: Dict[int, list] = {}
        try:
            self.root.mkdir(parents=self._make_out_dir, exist_ok=True)
            if d.is_symlink() or d.exists() and not d.is_dir():
                d.unlink(missing_ok=True)  # a file in the place of this round's folder is no checkpoint (a stray copy)
            d.mkdir(exist_ok=True)
            made = True
            if files is not None:
                files.check()
                target = d / CLIENT_DIR
                index = self._write_client_files(d, files)
                target = d / f"clients_{self.rank}.json"
                atomic_write_bytes(target, json.dumps({"rank": self.rank, "clients": index}).encode("utf-8"))
            else:
                part = {"rank": self.rank,
                        "clients": {int(c): _cpu(s) for c, s in client_states.items() if s is not None}}
                target = d / f"clients_{self.rank}.pt"
                atomic_torch_save(part, target)
            fault_point("checkpoint", rounds_done)  # the fault tests' hook: this part written, not the rest
            if self.rank == 0:
                target = d / "global.pt"
                atomic_torch_save(
                    {"round": rounds_done, "global": _cpu(global_state), "meta_json": json.dumps(meta)}, target
                )
        except OSError as exc:
            problem = _naming(exc, target)
            vanished = self._vanished(problem, d, made)
        if all_ok(problem is None):  # every part is on disk
            if self.rank == 0:
                try:
                    kind = "json" if files is not None else "pt"
                    parts = ["global.pt"] + [f"clients_{r}.{kind}" for r in range(self.world_size)]
                    manifest = {
                        "round": rounds_done,
                        "world_size": self.world_size,
                        "sha256": {p: _sha256(d / p) for p in parts},
                    }
                    if files is not None:
                        manifest["client_files"] = CLIENT_DIR
                    atomic_write_bytes(d / MARKER, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
                except OSError as exc:
                    problem = _naming(exc, d / MARKER)
                    vanished = self._vanished(problem, d, made)
            if all_ok(problem is None):  # nobody moves on before the checkpoint counts
                if files is not None:
                    self._base = (d, index)
                    files.saved()
                if self.rank == 0:
                    self._prune(d)
                return d
        if self.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        why = (f"{problem.filename + ': ' if problem.filename else ''}{problem.strerror or problem}" if problem is not None
               else "a write failed on another rank")
        if not self.root.parent.is_dir():
            after = (f"out_dir {self.root.parent} was removed while the run was going, its checkpoints with it: "
                     f"start the run again")
        elif vanished:  # an rm -rf of out_dir still under way, or of a part of it
            after = (f"out_dir {self.root.parent} was removed while the run was going, or a part of it ({d} went "
                     f"while it was written): start the run again")
        elif any((p / MARKER).is_file() for p in self.root.glob("round_*") if p != d):
            after = f"the previous complete checkpoint in {self.root} is intact"
        else:
            after = "no earlier checkpoint was complete: a restart begins afresh"
        raise RunFailure(f"the checkpoint after round {rounds_done} could not be written ({why}); {after}")

    @staticmethod
    def _vanished(problem: OSError, d: Path, made: bool) -> bool:
        """Whether this rank's failed write ``problem`` met the round's folder ``d``, made here, being
        removed: a file in it not found (the folder gone, or the temporary file this rank had just
        written there, which an ``rm -rf`` removes before the folder). Judged as the write fails,
        before any collective, since rank 0 removes the folder only once every rank has said how it
        fared: no cleanup of the run's own is under way then."""
        if not made or problem.errno != errno.ENOENT:
            return False
        name = Path(problem.filename) if problem.filename else None
        return name is not None and (name == d or d in name.parents)

    def _write_client_files(self, d: Path, files: ClientFiles) -> Dict[int, list]:
        """This rank's clients' files in ``d/clients``; {client: [SHA-256, size]}. A changed client's
        (or one the previous checkpoint lacks) is copied from the store's file, hashed as it is
        copied, and synced: the checkpoint never shares a file with the store's working space. An
        unchanged one is a hard link to the previous checkpoint's (:attr:`_base`; a copy of it where
        the file system has no hard links), its SHA-256 carried over."""
        folder = d / CLIENT_DIR
        folder.mkdir(exist_ok=True)
        base, known = self._base if self._base is not None else (None, {})
        index: Dict[int, list] = {}
        for c, src in files.paths.items():
            dst = folder / _client_file(c)
            old = None if c in files.changed else known.get(c)
            if old is not None and base is not None:
                prev = base / CLIENT_DIR / _client_file(c)
                if prev == dst or (prev.is_file() and prev.stat().st_size == old[1]):
                    if prev != dst:
                        dst.unlink(missing_ok=True)
                        if not _link(prev, dst):
                            _copy(prev, dst)
                    if dst.is_file():
                        index[c] = old
                        continue
            dst.unlink(missing_ok=True)
            index[c] = _copy(src, dst)
            if c in files.digests and index[c][0] != files.digests[c].hex():  # changed on disk since the store wrote it
                dst.unlink(missing_ok=True)
                raise OSError(errno.EIO, "it is not what the run wrote there (changed on disk since; resume from "
                                         "the previous checkpoint)", str(src))
        _fsync(folder)
        return index

    def _prune(self, fresh: Path) -> None:
        """Keep ``fresh`` (just written, its checksums taken from the files on disk) and the
        ``keep - 1`` newest older checkpoints that pass :meth:`verify`; remove every other one.

        A checkpoint is counted only once verified, so a damaged one never takes the slot of an
        intact one. Directories of rounds after ``fresh`` are leftovers of an earlier attempt that
        the run did not resume from (unfinished, or damaged): they go too, unless one verifies.
        """
        fresh_round = int(fresh.name[6:])
        kept = 1
        for r, d in reversed(self._round_dirs()):
            if d == fresh:
                continue
            if r > fresh_round:
                if (d / MARKER).exists() and self.verify(d, deep=False) is None:
                    continue  # intact and newer: never the run's to remove
            elif kept < self.keep and (d / MARKER).exists() and self.verify(d, deep=False) is None:
                kept += 1
                continue
            shutil.rmtree(d, ignore_errors=True)

    # -- reading -------------------------------------------------------------
    def _round_dirs(self) -> list[tuple[int, Path]]:
        return self.run.checkpoint_dirs()

    def exists(self) -> bool:
        return self.run.has_checkpoint()

    def verify(self, d: Path, deep: bool = True) -> Optional[str]:
        """None if the checkpoint in ``d`` is complete and intact, else what is wrong. Every part
        is checked against its SHA-256; a disk store's client files too when ``deep``, else only
        that each is there with its size (what pruning asks: resuming checks them whole)."""
        try:
            manifest = json.loads((d / MARKER).read_text())
            sums = manifest["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return "no valid COMPLETE marker"
        problem = _manifest_problem(manifest, d.name)
        if problem:  # a damaged marker whose checksums still match its parts must not pass for intact
            return f"its COMPLETE marker is damaged ({problem})"
        for name, digest in sums.items():
            p = d / name
            if not p.is_file():
                return f"{name} is missing"
            if _sha256(p) != digest:
                return f"{name} does not match its checksum"
        if not manifest.get("client_files"):
            return None
        try:
            index = {c: (str(digest), int(size)) for c, (digest, size) in _client_index(d, manifest).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "a clients_{r}.json index cannot be read"
        for c, (digest, size) in index.items():
            name = f"{CLIENT_DIR}/{_client_file(c)}"
            p = d / name
            if not p.is_file():
                return f"{name} is missing"
            if p.stat().st_size != size or (deep and _sha256(p) != digest):
                return f"{name} does not match its checksum"
        return None

    def latest(self, warn=print, reading: bool = False) -> Optional[Path]:
        """The newest complete, intact checkpoint; damaged newer ones are reported and skipped. None
        when there is no complete checkpoint; a one-line error when there are complete ones and
        every one is damaged (a disk store's unchanged client files are hard links shared by the
        kept checkpoints, so one damaged file can damage them all): starting over would discard
        the run's rounds without a word. ``reading``: for a tool that only reads the models
        (fedcp-analyze), whose way out is not a fresh run."""
        complete = [d for _, d in reversed(self._round_dirs()) if (d / MARKER).exists()]
        for i, d in enumerate(complete):
            problem = self.verify(d)
            if problem is None:
                return d
            if i + 1 < len(complete):
                warn(f"checkpoint {d} is damaged ({problem}); trying the previous one")
            else:
                if reading:
                    raise UserError(f"checkpoint {d} is damaged ({problem}), and so is every newer one in "
                                    f"{self.root}: no intact models to read; restore the damaged file from a copy")
                raise UserError(
                    f"checkpoint {d} is damaged ({problem}), and so is every newer one in {self.root}: "
                    f"nothing intact to resume from, and starting over would discard the run's rounds; "
                    f"restore the damaged file from a copy, or set overwrite=true to start afresh")
        return None

    def resume(self, store, cfg, owned: Iterable[int], device, echo, mmap: bool = False,
               data: Optional[dict] = None) -> Optional[tuple]:
        """Load the newest intact checkpoint into ``store`` (the global state and the ``owned``
        clients' states) after checking that it was made by the same experiment on the same data
        (``data``: this run's :func:`data_record`, on the first rank; the same content at another
        ``data.path`` is the same data) and that its tensors have this run's shapes;
        (rounds done, the records, the rounds' seconds, the whole metadata), or None when there is no
        checkpoint."""
        d = self.latest(warn=echo)
        if d is None:
            return None
        rounds_done, global_state, client_states, meta = self.load(d, owned, device, mmap=mmap)
        manifest = json.loads((d / MARKER).read_text())
        # a disk store's clients, as resumed, are this checkpoint's files: the next one links them
        self._base = (d, _client_index(d, manifest)) if manifest.get("client_files") else None
        # the data first: a shard that moved is the same data when its content is. Without ``data``
        # (the ranks but the first) the first rank's check decides on the data and on data.path
        same_data = check_same_data(meta.get("data"), data, cfg.out_dir, echo) if data is not None else True
        check_resume_config(meta.get("config", {}), cfg.to_dict(), cfg.out_dir, same_data=same_data)
        if rounds_done > cfg.rounds:
            raise UserError(f"config key 'rounds' is {cfg.rounds} but the checkpointed run in {cfg.out_dir} has done "
                            f"{rounds_done} rounds; resume with rounds >= {rounds_done}, or use another out_dir")
        if set(global_state) != set(store.global_state):
            raise UserError(f"checkpoint {d} does not hold this method's global state")
        for key, t in global_state.items():
            if tuple(t.shape) != tuple(store.global_state[key].shape):
                raise UserError(f"checkpoint {d}: global tensor '{key}' has shape {list(t.shape)} but this run's is "
                                f"{list(store.global_state[key].shape)} (another model or data?); use another "
                                f"out_dir, or overwrite=true to start afresh")
        _check_client_shapes(d, store, client_states)
        store.set_global(global_state)
        store.load_state_dict(client_states)
        echo(f"resuming from {d} ({rounds_done} round{'s' if rounds_done != 1 else ''} done)")
        return rounds_done, meta["records"], meta["round_seconds"], meta

    def load(self, d: Path, owned: Iterable[int], device, mmap: bool = False) -> tuple[int, dict, dict, dict]:
        """(rounds done, global state, states of the ``owned`` clients, metadata). ``mmap``: the
        clients' parts are mapped into memory (on the host) rather than read whole."""
        owned = set(int(c) for c in owned)
        try:
            on_host = mmap and torch.device(device).type == "cpu"  # a disk store maps large global tensors too
            g = torch.load(d / "global.pt", map_location=device, weights_only=True, **({"mmap": True} if on_host else {}))
            manifest = json.loads((d / MARKER).read_text())
            clients: dict = {}
            where = {"map_location": "cpu" if mmap else device, "weights_only": True, **({"mmap": True} if mmap else {})}
            if manifest.get("client_files"):  # a disk store's: a file per client
                for c in sorted(owned & set(_client_index(d, manifest))):
                    clients[c] = torch.load(d / CLIENT_DIR / _client_file(c), **where)
            else:
                for r in range(int(manifest["world_size"])):
                    part = torch.load(d / f"clients_{r}.pt", **where)
                    for c, s in part["clients"].items():
                        if int(c) in owned:
                            clients[int(c)] = s
            meta = json.loads(g["meta_json"])
        except Exception as exc:  # a part that passed its checksum but cannot be read
            raise UserError(f"checkpoint {d} cannot be read: {type(exc).__name__}: {exc}") from None
        return int(g["round"]), g["global"], clients, meta
