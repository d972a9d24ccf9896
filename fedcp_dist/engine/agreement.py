"""Start-up checks that the ranks of one job run one experiment: the same config, the same shard
content, and one ``out_dir`` that every rank sees.

Every rank reads its own config and shard, so a rank started with another override (a per-node
wrapper script, a stale environment), a stale node-local copy of the shard or a node-local
``out_dir`` would otherwise train apart from the others: silently, where the collectives still
match in size, or until the first checkpoint (which every rank writes into ``out_dir``). Each check
is one or two tiny all-gathers before any client trains; every rank compares the same gathered
values, so every rank stops together, each naming what differs.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
from pathlib import Path
from typing import List

import numpy as np
import torch

from fedcp_dist.rundir.code import code_digest
from fedcp_dist.config import flatten
from fedcp_dist.errors import UserError

#: config keys each rank may set for itself; every other key must be the same on every rank
PER_RANK_KEYS = {
    "data.path": "a rank may read its own copy of the shard (a node-local disk): the content is compared instead",
    "client_state_dir": "a node-local scratch disk",
    "client_state_budget_mb": "the memory of the rank's node",
    "device": "the rank's own hardware",
    "threads": "the rank's own cores",
    "fused_workers": "how the rank's cores share its groups (the same results)",
    "collective_timeout": "how long this rank waits",
    "rendezvous_timeout": "how long this rank waits",
}
#: the file rank 0 writes in out_dir for the other ranks to find, named by a fresh token each start
#: (a name no node has looked up before, so no file system cache answers for it); removed once they looked
MARKER = ".rank_check"
#: how long a rank looks for the marker (a shared file system may show a new file late)
MARKER_WAIT_SECONDS = 30.0


def digest64(data: bytes) -> int:
    """The first 8 bytes of ``data``'s SHA-256 as a signed 64-bit integer (a tensor element)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


def _gathered(rt, values: List[int]) -> torch.Tensor:
    """(world_size, len(values)): every rank's ``values``, in rank order."""
    return rt.all_gather(torch.tensor(values, dtype=torch.int64, device=rt.device)).cpu()


def _other_ranks(column: torch.Tensor) -> List[int]:
    """The ranks whose entry differs from rank 0's."""
    return [int(r) for r in torch.nonzero(column != column[0]).flatten()]


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def check_same_config(cfg, rt) -> None:
    """Every rank's config equals rank 0's but for :data:`PER_RANK_KEYS`; else a UserError on every
    rank naming the first key that differs, this rank's value and the ranks that differ."""
    if rt.world_size == 1:
        return
    flat = flatten(cfg.to_dict())
    keys = sorted(k for k in flat if k not in PER_RANK_KEYS)
    values = [digest64(json.dumps(flat[k], sort_keys=True, default=str).encode()) for k in keys]
    head = _gathered(rt, [digest64("\n".join(keys).encode()), digest64(json.dumps(values).encode()),
                          digest64(code_digest().encode())])
    code = _other_ranks(head[:, 2])
    if code:
        raise UserError(f"{_ranks(code)} run other fedcp_dist code than rank 0 (source digest {code_digest()} on rank "
                        f"{rt.rank}): install the same version on every node")
    versions = _other_ranks(head[:, 0])
    if versions:
        raise UserError(f"{_ranks(versions)} run a fedcp_dist whose config keys differ from rank 0's: install the "
                        f"same version on every node")
    if not _other_ranks(head[:, 1]):
        return
    per_key = _gathered(rt, values)
    differ = [(k, _other_ranks(per_key[:, i])) for i, k in enumerate(keys)]
    differ = [(k, ranks) for k, ranks in differ if ranks]
    key, ranks = differ[0]
    more = f" (and {len(differ) - 1} more: {', '.join(k for k, _ in differ[1:4])}{', …' if len(differ) > 4 else ''})" \
        if len(differ) > 1 else ""
    raise UserError(f"the ranks were started with different configs: {key} differs between rank 0 and "
                    f"{_ranks(ranks)}{more}; this is rank {rt.rank}, where {key} = {flat[key]!r}. Start every rank "
                    f"with the same config and overrides")


def shard_digest(info) -> int:
    """What two copies of one shard share: the fingerprint written with it, its clients' sample
    counts and its shape (cheap: nothing of the samples is read)."""
    h = hashlib.sha256()
    h.update(json.dumps([info.fingerprint, info.num_clients, info.num_classes, list(info.input_shape), info.kind],
                        default=str).encode())
    for counts in (info.train_counts, info.test_counts):
        h.update(np.ascontiguousarray(counts, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def check_same_shard(rt, info) -> None:
    """Every rank's shard is rank 0's (a copy is fine: same fingerprint, same clients' counts);
    else a UserError on every rank naming the ranks and this rank's file."""
    if rt.world_size == 1:
        return
    ranks = _other_ranks(_gathered(rt, [shard_digest(info)])[:, 0])
    if ranks:
        raise UserError(f"{_ranks(ranks)} read another shard than rank 0 (its fingerprint or its clients' sample "
                        f"counts differ; this is rank {rt.rank}, reading {info.path} with {info.num_clients} clients): "
                        f"every rank must read the same shard (a copy with the same content is fine)")


def marker_file(out_dir, token: int) -> Path:
    return Path(out_dir) / f"{MARKER}-{token:016x}"


def check_shared_out_dir(rt, out_dir) -> None:
    """Every rank sees the ``out_dir`` rank 0 writes in (checkpoints are written there by every
    rank): rank 0 writes a random token to a file named by it (:func:`marker_file`), the others
    read it back; else a
    UserError on every rank naming the ranks that do not see it. Rank 0 removes the marker."""
    if rt.world_size == 1:
        return
    token = secrets.randbits(62) if rt.is_main else 0
    if rt.is_main:
        try:
            marker_file(out_dir, token).write_text(f"{token}\n")
        except OSError as exc:  # a full disk: the file may be made and its write fail; none is left behind
            with contextlib.suppress(OSError):
                marker_file(out_dir, token).unlink(missing_ok=True)
            token, why = -1, exc.strerror
    token = int(_gathered(rt, [token])[0, 0])  # rank 0's
    if token == -1:
        raise UserError(f"out_dir {out_dir}: rank 0 could not write in it" + (f" ({why})" if rt.is_main else ""))
    marker = marker_file(out_dir, token)
    seen = rt.is_main
    deadline = time.monotonic() + MARKER_WAIT_SECONDS
    while not seen:
        try:
            seen = marker.read_text().strip() == str(token)
        except (OSError, ValueError):
            pass
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    blind = [int(r) for r in torch.nonzero(_gathered(rt, [0 if seen else 1])[:, 0]).flatten()]
    if rt.is_main:
        marker.unlink(missing_ok=True)
    if blind:
        raise UserError(f"out_dir {Path(out_dir).resolve()} is not the folder rank 0 writes in on {_ranks(blind)} (they do "
                        f"not see the file rank 0 wrote there): out_dir must be on a file system every rank "
                        f"shares, not a node-local disk")
