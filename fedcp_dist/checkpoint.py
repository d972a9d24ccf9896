"""Round-R checkpoints: written atomically, complete only when every part is, the last k kept.

Layout of ``out_dir/checkpoints/round_{R:07d}/`` (R = rounds trained):

* ``global.pt``        rank 0: the global state, R, and the run's metadata as JSON (the metric
                       records so far and the config); the random streams need nothing more,
                       since every draw derives from (seed, round, client)
* ``clients_{r}.pt``   rank r: the persistent state of the clients it owns, keyed by client id
                       (so a checkpoint can be resumed on another world size)
* ``COMPLETE``         rank 0, after every rank has written its part: the world size and a
                       SHA-256 of every part. A directory without it, or whose parts do not
                       match it, does not count.

Every file is written to a temporary name, flushed to disk and renamed.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch

from fedcp_dist.errors import RunFailure, UserError
from fedcp_dist.fileio import atomic_torch_save, atomic_write_bytes
from fedcp_dist.rundir import CHECKPOINTS

_ROUND_DIR = re.compile(r"^round_(\d{7})$")
MARKER = "COMPLETE"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_torch_save(obj, path: Path) -> None:
    atomic_torch_save(obj, path)


def _atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` where it names no file or only ``path``'s temporary file."""
    if not exc.filename or Path(str(exc.filename)).name.startswith(f".{path.name}.tmp"):
        exc.filename = str(path)
    return exc


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu() for k, v in state.items()}


class Checkpointer:
    def __init__(self, out_dir: str, rank: int, world_size: int, keep: int):
        self.root = Path(out_dir) / CHECKPOINTS
        self.rank = rank
        self.world_size = world_size
        self.keep = max(1, keep)

    # -- writing -------------------------------------------------------------
    def save(self, rounds_done: int, global_state: dict, client_states: dict, meta: dict, all_ok) -> Path:
        """Every rank calls this with its own clients; returns the checkpoint directory.

        ``all_ok(ok)`` is a collective: True when every rank passes True. A write that fails on
        any rank (a full disk, say) leaves the previous checkpoint as the newest complete one and
        raises :class:`RunFailure` on every rank.
        """
        d = self.root / f"round_{rounds_done:07d}"
        problem = None
        target = d
        try:
            d.mkdir(parents=True, exist_ok=True)
            part = {"rank": self.rank, "clients": {int(c): _cpu(s) for c, s in client_states.items() if s is not None}}
            target = d / f"clients_{self.rank}.pt"
            _atomic_torch_save(part, target)
            if self.rank == 0:
                target = d / "global.pt"
                _atomic_torch_save(
                    {"round": rounds_done, "global": _cpu(global_state), "meta_json": json.dumps(meta)}, target
                )
        except OSError as exc:
            problem = _naming(exc, target)
        if all_ok(problem is None):  # every part is on disk
            if self.rank == 0:
                try:
                    parts = ["global.pt"] + [f"clients_{r}.pt" for r in range(self.world_size)]
                    manifest = {
                        "round": rounds_done,
                        "world_size": self.world_size,
                        "sha256": {p: _sha256(d / p) for p in parts},
                    }
                    _atomic_write_text(d / MARKER, json.dumps(manifest, indent=1) + "\n")
                except OSError as exc:
                    problem = _naming(exc, d / MARKER)
            if all_ok(problem is None):  # nobody moves on before the checkpoint counts
                if self.rank == 0:
                    self._prune()
                return d
        if self.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        why = (f"{problem.filename + ': ' if problem.filename else ''}{problem.strerror or problem}" if problem is not None
               else "a write failed on another rank")
        raise RunFailure(
            f"the checkpoint after round {rounds_done} could not be written ({why}); "
            f"the previous complete checkpoint in {self.root} is intact"
        )

    def _prune(self) -> None:
        complete = [d for _, d in self._round_dirs() if (d / MARKER).exists()]
        keep = set(complete[-self.keep :])
        newest = complete[-1] if complete else None
        for r, d in self._round_dirs():
            if d in keep:
                continue
            # older complete ones beyond k, and leftovers of interrupted writes older than the newest
            if (d / MARKER).exists() or (newest is not None and r < int(newest.name[6:])):
                shutil.rmtree(d, ignore_errors=True)

    # -- reading -------------------------------------------------------------
    def _round_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        out = []
        for d in self.root.iterdir():
            m = _ROUND_DIR.match(d.name)
            if m and d.is_dir():
                out.append((int(m.group(1)), d))
        return sorted(out)

    def exists(self) -> bool:
        return any((d / MARKER).exists() for _, d in self._round_dirs())

    def verify(self, d: Path) -> Optional[str]:
        """None if the checkpoint in ``d`` is complete and intact, else what is wrong."""
        try:
            manifest = json.loads((d / MARKER).read_text())
            sums = manifest["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return "no valid COMPLETE marker"
        for name, digest in sums.items():
            p = d / name
            if not p.is_file():
                return f"{name} is missing"
            if _sha256(p) != digest:
                return f"{name} does not match its checksum"
        return None

    def latest(self, warn=print) -> Optional[Path]:
        """The newest complete, intact checkpoint; damaged newer ones are reported and skipped."""
        for _, d in reversed(self._round_dirs()):
            if not (d / MARKER).exists():
                continue
            problem = self.verify(d)
            if problem is None:
                return d
            warn(f"checkpoint {d} is damaged ({problem}); trying the previous one")
        return None

    def resume(self, store, cfg, owned: Iterable[int], device, echo, mmap: bool = False) -> Optional[tuple]:
        """Load the newest intact checkpoint into ``store`` (the global state and the ``owned``
        clients' states) after checking that it was made by the same experiment; (rounds done, the
        records, the rounds' seconds), or None when there is no checkpoint."""
        from fedcp_dist.rundir import check_resume_config

        d = self.latest(warn=echo)
        if d is None:
            return None
        rounds_done, global_state, client_states, meta = self.load(d, owned, device, mmap=mmap)
        check_resume_config(meta.get("config", {}), cfg.to_dict(), cfg.out_dir)
        if set(global_state) != set(store.global_state):
            raise UserError(f"checkpoint {d} does not hold this method's global state")
        store.set_global(global_state)
        store.load_state_dict(client_states)
        echo(f"resuming from {d} ({rounds_done} rounds done)")
        return rounds_done, meta["records"], meta["round_seconds"]

    def load(self, d: Path, owned: Iterable[int], device, mmap: bool = False) -> tuple[int, dict, dict, dict]:
        """(rounds done, global state, states of the ``owned`` clients, metadata). ``mmap``: the
        clients' parts are mapped into memory (on the host) rather than read whole."""
        owned = set(int(c) for c in owned)
        try:
            on_host = mmap and torch.device(device).type == "cpu"  # a disk store maps large global tensors too
            g = torch.load(d / "global.pt", map_location=device, weights_only=True, **({"mmap": True} if on_host else {}))
            manifest = json.loads((d / MARKER).read_text())
            clients: dict = {}
            for r in range(int(manifest["world_size"])):
                part = torch.load(d / f"clients_{r}.pt", map_location="cpu" if mmap else device, weights_only=True,
                                  **({"mmap": True} if mmap else {}))
                for c, s in part["clients"].items():
                    if int(c) in owned:
                        clients[int(c)] = s
            meta = json.loads(g["meta_json"])
        except Exception as exc:  # a part that passed its checksum but cannot be read
            raise UserError(f"checkpoint {d} cannot be read: {type(exc).__name__}: {exc}") from None
        return int(g["round"]), g["global"], clients, meta
