"""A run's start-up on this rank: everything :class:`~fedcp_dist.engine.simulator.Simulator`'s round loop
works with, built in order, each step agreed on by every rank.

1. rank 0 locks ``out_dir`` (the overwrite and resume rules); every rank reads the shard's
   metadata, builds the model and the method (before the clients are placed: fused groups are
   placed whole) and places the clients (:func:`fedcp_dist.engine.startup.load`);
2. the peer exchange's memory is checked, the global state made, the client store opened (a disk
   store locks its folder), the rank's clients' data loaded or the shard opened for reads as rounds
   need them (:func:`fedcp_dist.engine.startup.load_data`) and the training path chosen (fused or
   one client at a time);
3. ``dp: central``'s mechanism (its noise calibrated for a target ε), the aggregator's buffer, the
   compressor and the cohort trainer; the memory the rounds will take is estimated and checked
   against what is free (:mod:`fedcp_dist.engine.preflight`); the run directory's writer;
4. resume from the newest verified checkpoint (``resume: auto``), the room the checkpoints still
   to write will take on out_dir's disk checked (:mod:`fedcp_dist.rundir.room`), and
   analysis.jsonl kept up to the rounds done.

A refusal on any rank stops every rank (:func:`fedcp_dist.engine.startup.agree_on`); what start-up made
that holds a lock or a file (the out_dir lock, the store, the writer) is closed again before the
error goes on, so a later run in the same process may take them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

from fedcp_dist.capabilities import Probes, supports
from fedcp_dist.engine import agreement, startup
from fedcp_dist.rundir.code import code_note
from fedcp_dist.comm.aggregate import ClientOrder, FlatAggregator, TrainSums, sums_size
from fedcp_dist.rundir.checkpoint import Checkpointer, data_record
from fedcp_dist.rundir.room import checkpoint_room
from fedcp_dist.state.client_store import BN_STAT_SUFFIXES
from fedcp_dist.state.disk_store import DiskClientStore, make_store
from fedcp_dist.comm.compress import Compressor
from fedcp_dist.config import Config
from fedcp_dist.engine.evaluation import EvalSums
from fedcp_dist.fused.groups import GroupTrainer, group_size as fused_group_size
from fedcp_dist.comm.privacy import CentralDP, PrivacySums, plan_run
from fedcp_dist.engine.preflight import peer_rows, preflight
from fedcp_dist.engine.probes import RoundProbes
from fedcp_dist.rundir.directory import RunDir, RunWriter
from fedcp_dist.fileio import folders_to_make
from fedcp_dist.rundir.out_dir import prepare_out_dir, unmake_out_dir
from fedcp_dist.runtime import Runtime
from fedcp_dist.engine.training import CohortTrainer


@dataclass
class RunParts:
    """What start-up made. ``fused``/``path``: the training path and how the start line names it;
    ``start_round``, ``records``, ``round_seconds``: the rounds done (from a checkpoint, else none)."""

    setup: startup.Setup
    algo: object
    store: object
    store_line: str
    fused: bool
    path: str
    agg: FlatAggregator
    compressor: Compressor
    trainer: CohortTrainer
    writer: RunWriter
    lock: object
    #: [(key, why)] of the config's keys that have no effect in this run (the start line names them)
    idle_keys: List[tuple] = field(default_factory=list)
    #: the memory the run's rounds will take at their peak, estimated before the first (a line)
    memory: str = ""
    #: the room the run's checkpoints will take on out_dir's disk, against what is free there (a line)
    disk: str = ""
    #: ``dp: central``'s mechanism (None: off)
    dp: Optional[CentralDP] = None
    start_round: int = 0
    records: List[dict] = field(default_factory=list)
    round_seconds: List[float] = field(default_factory=list)
    #: what sets the training's rounding beside the config (:func:`startup.arithmetic`): checkpoints
    #: record it, and a resume under another says the run goes on equal up to rounding
    arithmetic: str = ""


def run_data_record(cfg: Config, setup: startup.Setup) -> Optional[dict]:
    """The shard a run trains on, as its checkpoints record it and resume checks it (None on the
    ranks that did not hash it: the first rank checks the data for every rank)."""
    if setup.digest is None:
        return None
    return data_record(cfg.data.path, setup.info.fingerprint, setup.layout, setup.digest, setup.info.num_clients)


def close_parts(parts, failed: bool) -> None:
    """Close each of ``parts`` (None: not made), even when one before it fails; the first error is
    raised unless the run has ``failed`` already."""
    first = None
    for part in parts:
        try:
            if part is not None:
                part.close()
        except Exception as exc:
            first = first or exc
    if first is not None and not failed:
        raise first


def start_run(cfg: Config, rt: Runtime, ckpt: Checkpointer, echo: Callable[[str], None],
              wrap: Optional[Callable] = None) -> RunParts:
    """Start-up, steps 1–4 of the module's list. ``wrap`` (for tests) wraps the method the config
    names; ``echo`` says what resume found (rank 0)."""
    made = {"lock": None, "store": None, "data": None, "writer": None, "new_dir": []}
    try:
        return _start(cfg, rt, ckpt, echo, wrap, made)
    except BaseException:  # what was locked is released
        close_parts((made["store"], made["data"], made["writer"]), failed=True)
        if isinstance(made["store"], DiskClientStore):  # what it made for a start that did not happen
            made["store"].unmake()
        if made["new_dir"]:  # while the lock is still held: no other run can have taken the folder
            unmake_out_dir(cfg.out_dir, made["new_dir"])
        close_parts((made["lock"],), failed=True)
        raise


def _start(cfg, rt, ckpt, echo, wrap, made: dict) -> RunParts:
    built = {}

    def build(info, num_clients: int) -> int:
        algo = startup.build_method(cfg, info, num_clients, rt.device)  # the same initial model on every rank
        built["algo"] = algo = wrap(algo) if wrap else algo
        fusing, _ = startup.training_path(cfg, algo, False)
        return fused_group_size(cfg, rt.device, num_clients) if fusing else 0

    def lock_and_load() -> startup.Setup:
        if rt.is_main:  # rank 0 alone writes out_dir: it takes the lock and applies the rules
            new = folders_to_make(cfg.out_dir)
            made["lock"] = prepare_out_dir(cfg.out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
            made["new_dir"] = new
        return startup.load(cfg, rt, build)

    agreement.check_same_config(cfg, rt)  # before rank 0 touches out_dir: a refused start changes nothing
    # the phase names the step a long start-up is at (rank 0's heartbeat line, a failed collective's error)
    rt.phase = "start-up (the shard and the method)"
    s = startup.agree_on(rt, lock_and_load)
    agreement.check_same_shard(rt, s.info)
    agreement.check_shared_out_dir(rt, cfg.out_dir)
    algo = built["algo"]
    startup.check_peer_memory(cfg, algo, s.num_clients, peer_rows(s, rt.world_size), rt.world_size)
    global_state = algo.init_global_state()
    # a disk store locks its folder: a refusal on any rank stops every rank
    rt.phase = "start-up (the client states)"
    store, store_line = startup.agree_on(rt, lambda: make_store(cfg, algo, global_state, s.owned, rt.device, rt.rank,
                                                                    rt.world_size))
    made["store"] = store
    # the clients' data: resident, or read as rounds need them (client_data; auto follows the store)
    rt.phase = "start-up (the clients' data)"
    startup.agree_on(rt, lambda: startup.load_data(cfg, rt, s, isinstance(store, DiskClientStore)))
    made["data"] = s.data
    # per-client BatchNorm statistics (known once the store is) keep the clients sequential
    fused, path = startup.training_path(cfg, algo, bool(store.bn_keys))
    upload = [k for k in algo.upload_keys(global_state) if k not in store.bn_keys]
    layout = algo.probe_layout if supports(algo, Probes) else None
    idle = cfg.keys_without_effect()
    if cfg.aggregate_bn_stats and not any(k.endswith(BN_STAT_SUFFIXES) for k in algo.upload_keys(global_state)):
        idle.append(("aggregate_bn_stats", "the uploads hold no BatchNorm statistics"))
    rt.phase = "start-up"
    # dp=central: the mechanism (its noise multiplier calibrated here when dp_target_epsilon is set)
    dp = startup.agree_on(rt, lambda: CentralDP(cfg, plan_run(cfg, s.num_clients))) if cfg.dp == "central" else None
    # the per-client rows of the all-reduce follow the largest cohort and the evaluated clients, not N
    evaluated = len(s.eval_ids)
    agg = FlatAggregator({k: global_state[k].shape for k in upload},
                         sums_size(TrainSums, EvalSums, *((PrivacySums,) if dp else ())), rt.device,
                         extra=RoundProbes.size(cfg.probe_every, s.max_cohort, layout, eval_rows=evaluated),
                         groups=algo.aggregation_groups(upload),
                         rows=ClientOrder.size(TrainSums, s.max_cohort) + ClientOrder.size(EvalSums, evaluated))
    compressor = Compressor.from_config(cfg, agg.shapes)
    groups = (GroupTrainer(cfg, algo, store, s.data, s.owned_groups(rt.rank), rt.device, rows=s.batch_rows(cfg))
              if fused and s.groups is not None else None)
    trainer = CohortTrainer(cfg, rt, algo, store, s.data, s.owner, groups, agg, compressor, dp)
    # the memory the rounds will take, against what is free: a run that cannot fit stops here, in one line
    memory = startup.agree_on(rt, lambda: preflight(cfg, rt, s, algo, store, agg, compressor, groups))
    made["writer"] = writer = RunWriter(cfg.out_dir, rt.is_main, cfg.logger, layout.scalars if layout else None)
    writer.hold(made["lock"])
    parts = RunParts(s, algo, store, store_line, fused, path, agg, compressor, trainer, writer, made["lock"], idle,
                     memory=memory or "", dp=dp,
                     arithmetic=startup.arithmetic(cfg, rt, fused and s.groups is not None, s.num_clients))

    def maybe_resume() -> None:
        # a disk store takes the states one by one from the checkpoint mapped into memory
        done = cfg.resume == "auto" and ckpt.resume(store, cfg, s.owned, rt.device, echo,
                                                    mmap=isinstance(store, DiskClientStore),
                                                    data=run_data_record(cfg, s))
        if done:
            parts.start_round, parts.records, parts.round_seconds, meta = done
            if dp is not None:  # the clip norm adaptive clipping reached; ε follows from the rounds done
                dp.load_state_dict(meta.get("privacy"))
            for note in (code_note(meta.get("code")), startup.arithmetic_note(meta.get("arithmetic"), parts.arithmetic)):
                if note:
                    echo(note)

    if cfg.resume == "auto" and RunDir(cfg.out_dir).has_checkpoint():
        rt.phase = "start-up (resuming from the newest checkpoint)"
    startup.agree_on(rt, maybe_resume)
    rt.phase = "start-up"
    # the checkpoints still to write, against the room on out_dir's disk (rank 0: out_dir is shared)
    parts.disk = startup.agree_on(rt, lambda: checkpoint_room(cfg, s, algo, store, agg, compressor, parts.start_round)
                                  if rt.is_main else "") or ""
    # analysis.jsonl: the lines of the rounds done kept, the rest computed again
    startup.agree_on(rt, lambda: writer.start_analysis(parts.start_round, create=bool(cfg.probe_every)))
    return parts
