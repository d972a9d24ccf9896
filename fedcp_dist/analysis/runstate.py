"""A finished (or checkpointed) run, rebuilt in memory: its config, shard, method and states.

Grad-CAM and the DLG attack both need the models a run actually had, so they rebuild the run's
method exactly as the engine does (:func:`fedcp_dist.engine.startup.build_method`) and load the newest
complete checkpoint into it.

Which states: the global state *and* the clients' states of the newest checkpoint, a pair that
existed together (the personalized models as evaluated after that many rounds). A run with
``checkpoint_every`` > 0 also checkpoints after its last round, so these are its final models;
the round used is always reported.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from fedcp_dist.state.client_store import ClientStore
from fedcp_dist.errors import UserError

@dataclass
class RunState:
    """A run's method with the states of its newest checkpoint loaded."""

    run_dir: Path
    cfg: object  # fedcp_dist.config.Config
    info: object  # fedcp_dist.data.shards.ShardInfo
    algo: object  # fedcp_dist.algorithms.base.Algorithm
    device: torch.device
    #: rounds trained when the checkpoint was written
    rounds_done: int
    #: the clients' states and their own BatchNorm statistics, as the engine keeps them
    store: ClientStore
    #: the shard's ids of the run's clients 0 … K − 1 (``data.clients``; all of the shard's by default)
    clients: object = None

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def global_state(self) -> dict:
        return self.store.global_state

    def sent(self, cid: int) -> dict:
        """The global state as client ``cid``'s model received it (with its own BatchNorm statistics)."""
        return {**self.global_state, **self.store.bn.get(cid, {})}

    def use_client(self, cid: int) -> Optional[dict]:
        """Hand the method the global state (with ``cid``'s own BatchNorm statistics, if any) and
        return ``cid``'s persistent state (the method's initial one if the client never trained)."""
        self.algo.set_global(self.sent(cid))
        return self.store.get(cid)

    def load_data(self, cids) -> dict:
        """``{cid: ClientData}`` of the given clients, on the run's device."""
        from fedcp_dist.data.resident import to_device
        from fedcp_dist.data.shards import load_clients

        bad = [c for c in cids if not 0 <= c < self.num_clients]
        if bad:
            raise UserError(f"client {bad[0]} is not in {self.run_dir} (clients 0..{self.num_clients - 1})")
        arrays = load_clients(self.cfg.data.path, [int(self.clients[c]) for c in cids])
        return {c: to_device(c, arrays[int(self.clients[c])], self.info.mean, self.info.std, self.device)
                for c in cids}


def run_config(run_dir: Path, data_path: Optional[str] = None, changes: Optional[dict] = None):
    """The run's resolved config (``config.yaml``), with ``data.path`` replaced by ``data_path`` if
    given and attributes set from ``changes``; a missing shard is a one-line error."""
    from fedcp_dist.config import flatten, legacy_defaults, load_config, read_yaml_mapping

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(str(path), validate=False)
    for key, value in legacy_defaults(flatten(read_yaml_mapping(path, "run config"))).items():
        setattr(cfg, key, value)  # a run written before the key existed, as it ran
    if data_path is not None:
        cfg.data.path = data_path
        if not os.path.isfile(data_path):
            raise UserError(f"--data {data_path}: no such file (the run's HDF5 partition)")
    if not os.path.isfile(cfg.data.path):
        raise UserError(f"{run_dir}: the run's shard {cfg.data.path} is not found from {os.getcwd()}; "
                        f"give its path with --data")
    for key, value in (changes or {}).items():
        setattr(cfg, key, value)
    cfg.validate()
    return cfg


def _records(run) -> list:
    """The run's records (metrics.jsonl), none where it cannot be read whole."""
    try:
        return run.read_metrics()
    except UserError:
        return []


def load_run_state(run_dir, data_path: Optional[str] = None, device: str = "cpu",
                   changes: Optional[dict] = None, warn: Callable[[str], None] = print) -> RunState:
    """Rebuild the run in ``run_dir`` with the states of its newest complete checkpoint.

    ``changes`` sets config attributes before the method is built (evaluation without Gumbel
    noise, a batch size of the attacked client's, ...). A run without a checkpoint is a one-line
    error that says how to get one.
    """
    from fedcp_dist.rundir.checkpoint import Checkpointer
    from fedcp_dist.data.shards import read_info
    from fedcp_dist.engine.startup import build_method, run_clients

    run_dir = Path(run_dir)
    cfg = run_config(run_dir, data_path, changes)
    ckpt = Checkpointer(str(run_dir), 0, 1, max(1, cfg.keep_checkpoints)).latest(warn=warn, reading=True)
    if ckpt is None and cfg.checkpoint_every:
        from fedcp_dist.rundir.directory import RunDir

        due = min(cfg.checkpoint_every, cfg.rounds)
        done = sum(1 for r in _records(RunDir(run_dir)) if r.get("kind") == "round")
        why = (f"the run ended before its first one, due after round {due} (checkpoint_every={cfg.checkpoint_every})"
               if done < due else
               f"its {done} rounds recorded should have left one (checkpoint_every={cfg.checkpoint_every}): the "
               f"checkpoints were removed or damaged")
        raise UserError(f"{run_dir} has no complete checkpoint: {why}, and the clients' states are kept only in "
                        f"checkpoints")
    if ckpt is None:
        raise UserError(
            f"{run_dir} has no complete checkpoint, and the clients' states are kept only in checkpoints: "
            f"run it again with checkpoint_every set (> 0; a run then also checkpoints after its last round)"
        )
    dev = torch.device(device)
    info = read_info(cfg.data.path)
    if info.num_clients != (cfg.data.num_clients or info.num_clients):
        raise UserError(f"{run_dir}: the shard {cfg.data.path} holds {info.num_clients} clients, the run "
                        f"had {cfg.data.num_clients}")
    clients = run_clients(cfg, info)
    algo = build_method(cfg, info, len(clients), dev)  # the run's initial model, as the engine builds it
    rounds_done, global_state, states, meta = Checkpointer(str(run_dir), 0, 1, 1).load(
        ckpt, range(len(clients)), dev)
    recorded = (meta.get("data") or {}).get("fingerprint") if isinstance(meta, dict) else None
    if recorded and info.fingerprint and recorded != info.fingerprint:
        raise UserError(f"{run_dir}: the shard {cfg.data.path} is not the one the run was made on (its fingerprint "
                        f"{info.fingerprint[:12]}…, the run's {recorded[:12]}…): its clients' models would meet other "
                        f"clients' data; give the run's shard with --data")
    template = algo.init_global_state()
    if set(template) - set(global_state):
        missing = sorted(set(template) - set(global_state))[0]
        raise UserError(f"checkpoint {ckpt} does not fit the run's {cfg.method} model (no '{missing}')")
    store = ClientStore.for_run(algo, global_state, cfg.aggregate_bn_stats)
    store.load_state_dict(states)
    return RunState(run_dir, cfg, info, algo, dev, rounds_done, store, clients)

