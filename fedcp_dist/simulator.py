"""The round loop. Identical control flow on every rank; one all-reduce per round (and, with
feature-difference client selection, one before it that gathers the client vectors).

The pieces it wires: :mod:`startup` (shard, placement, loading), :mod:`client_store` (per-client
state), :mod:`evaluation`, :mod:`aggregate` (the one all-reduce and the peer exchange),
:mod:`checkpoint` and :mod:`rundir` (what rank 0 writes).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from fedcp_dist import startup
from fedcp_dist.aggregate import FlatAggregator, TrainSums, exchange_peers, reduce_sums, sums_size
from fedcp_dist.algorithms import make_algorithm
from fedcp_dist.algorithms.base import Context
from fedcp_dist.checkpoint import Checkpointer
from fedcp_dist.client_store import DiskClientStore, make_store, memory_record
from fedcp_dist.compress import Compressor, byte_totals, uplink_record
from fedcp_dist.config import Config, dump_config
from fedcp_dist.errors import Preempted, RunFailure, UserError
from fedcp_dist.evaluation import EvalSums, evaluate_clients
from fedcp_dist.placement import STREAM_EVAL, STREAM_PROBE, STREAM_TRAIN, stream_seed
from fedcp_dist.probes import ProbeTable
from fedcp_dist.rundir import RunWriter, check_resume_config, prepare_out_dir, progress_line, result_table, run_summary
from fedcp_dist.runtime import Runtime, StopSignals
from fedcp_dist.selection import draw_cohort, gather_client_vectors, selection_counts


class Simulator:
    """One run on this rank. ``wrap`` (for tests) wraps the algorithm the config names."""

    def __init__(self, cfg: Config, rt: Runtime, echo: Callable[[str], None] = print, wrap: Callable = None):
        self.cfg, self.rt = cfg, rt
        self.echo = echo if rt.is_main else (lambda *_: None)
        self._lock = None
        self.stop = StopSignals(rt.rank, (cfg.preempt_signal, "SIGTERM"))
        self.ckpt = Checkpointer(cfg.out_dir, rt.rank, rt.world_size, cfg.keep_checkpoints)
        self.setup = s = startup.agree_on(rt, self._lock_and_load)
        self.num_clients, self.owner, self.owned, self.data = s.num_clients, s.owner, s.owned, s.data

        torch.manual_seed(cfg.seed)  # the same initial model on every rank
        model = startup.model_for_shard(cfg, s.info)
        algo = make_algorithm(cfg.method, cfg, model, rt.device)
        algo.num_clients = self.num_clients
        self.algo = wrap(algo) if wrap else algo
        self.peer_bytes = startup.check_peer_memory(cfg, algo, self.num_clients,
                                                    int(s.clients_per_rank(rt.world_size).max()), rt.world_size)
        global_state = algo.init_global_state()
        self.store, self.store_line = make_store(cfg, self.algo, global_state, self.owned, rt.device, rt.rank)
        self.fused, self.path = startup.training_path(cfg, self.algo, bool(self.store.bn_keys))
        #: rounds between training probes (0: analysis off); their rows ride at the end of the all-reduce
        self.probe_every = cfg.probe_every
        upload = [k for k in algo.upload_keys(global_state) if k not in self.store.bn_keys]
        self.agg = FlatAggregator({k: global_state[k].shape for k in upload}, sums_size(TrainSums, EvalSums), rt.device,
                                  extra=ProbeTable.size(self.num_clients) if self.probe_every else 0,
                                  groups=algo.aggregation_groups(upload))
        self.compressor = Compressor.from_config(cfg, self.agg.shapes)
        self.select_by_features = cfg.client_selection == "feature_difference"
        self.writer = RunWriter(cfg.out_dir, rt.is_main, cfg.logger)
        self.start_round, self.records, self.round_seconds = 0, [], []
        startup.agree_on(rt, self._maybe_resume)
        # analysis.jsonl: the lines of the rounds done kept, the rest computed again
        startup.agree_on(rt, lambda: self.writer.start_analysis(self.start_round, create=bool(self.probe_every)))

    def _lock_and_load(self) -> startup.Setup:
        if self.rt.is_main:  # rank 0 alone writes out_dir: it takes the lock and applies the rules
            self._lock = prepare_out_dir(self.cfg.out_dir, overwrite=self.cfg.overwrite, resume=self.cfg.resume)
        return startup.load(self.cfg, self.rt)

    @property
    def global_state(self):
        return self.store.global_state

    # -- resume and checkpoints --------------------------------------------------------------
    def _maybe_resume(self) -> None:
        if self.cfg.resume != "auto":
            return
        d = self.ckpt.latest(warn=self.echo)
        if d is None:
            return
        # a disk store takes the states one by one from the checkpoint mapped into memory
        mmap = isinstance(self.store, DiskClientStore)
        rounds_done, global_state, client_states, meta = self.ckpt.load(d, self.owned, self.rt.device, mmap=mmap)
        check_resume_config(meta.get("config", {}), self.cfg.to_dict(), self.cfg.out_dir)
        if set(global_state) != set(self.global_state):
            raise UserError(f"checkpoint {d} does not hold this method's global state")
        self.store.set_global(global_state)
        self.store.load_state_dict(client_states)
        self.start_round, self.records, self.round_seconds = rounds_done, meta["records"], meta["round_seconds"]
        self.echo(f"resuming from {d} ({rounds_done} rounds done)")

    def _save_checkpoint(self, rounds_done: int) -> None:
        self.rt.phase = f"checkpoint after round {rounds_done}"
        meta = {"records": self.records, "round_seconds": self.round_seconds, "config": self.cfg.to_dict()}
        self.ckpt.save(rounds_done, self.global_state, self.store.state_dict(), meta,
                       lambda ok: startup.all_ok(self.rt, ok))

    # -- one round's pieces --------------------------------------------------------------------
    def _generator(self, *keys: int) -> torch.Generator:
        return torch.Generator(device=self.rt.device).manual_seed(stream_seed(self.cfg.seed, *keys))

    def evaluate(self, round_idx: int, probes: dict = None) -> EvalSums:
        """This rank's sums of its clients' personalized test metrics (and, into ``probes``, their
        evaluation probes)."""
        self.store.prefetch(self.owned)
        return evaluate_clients(self.algo, self.store, self.data, self.owned, round_idx,
                                lambda t, c: self._generator(STREAM_EVAL, t, c), self.cfg.eval_batch_size, probes)

    def _train(self, t: int, cids: list, probe: bool = False):
        """(client, LocalResult) for this rank's participants, one by one or in fused groups."""
        self.store.prefetch(cids)  # a store off the device reads the next clients' states while one trains
        ctxs = [Context(t, c, self._generator(STREAM_TRAIN, t, c), probe) for c in cids]
        if self.fused:
            items = [(self.store.get(c), self.data[c], ctx) for c, ctx in zip(cids, ctxs)]
            yield from zip(cids, self.algo.train_fused(items))
            return
        for c, ctx in zip(cids, ctxs):
            yield c, self.algo.local_train(self.store.activate(c), self.data[c], ctx)

    def _probe_training(self, t: int, cid: int, res, table: ProbeTable) -> None:
        """Client ``cid``'s training probes of round t into ``table``; before its new state is kept."""
        before = self.store.activate(cid)  # its state before this round, the global state as it received it
        bef, aft = self.algo.probe_losses(before, res, self.data[cid], Context(t, cid, self._generator(STREAM_PROBE, t, cid)))
        n = self.data[cid].n_train
        table.add_train(cid, res.samples, res.tallies.get("s", 0.0), bef, aft, n)

    def _cohort(self, t: int):
        """Round t's sorted cohort: uniform, or drawn by feature difference when ρ < 1."""
        return draw_cohort(self.cfg, t, self.setup.info.train_counts[self.setup.clients],
                           lambda: gather_client_vectors(self.rt, self.algo, self.store, self.owned, self.num_clients))

    def _exchange_peers(self, t: int, cohort, payloads: dict) -> float:
        """One all-gather of the participants' peer payloads; the algorithm updates the global state."""
        t0 = time.perf_counter()
        self.rt.phase = f"round {t + 1}: peer exchange"
        peers = exchange_peers(self.rt, self.owner, cohort, payloads, self.algo.peer_dim)
        self.store.set_global(self.algo.receive_peers(t, self.global_state, peers))
        self.rt.phase = f"round {t + 1}"
        return time.perf_counter() - t0

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Every round from the first not yet done, checkpoints, then the final evaluation; the summary."""
        try:
            with self.stop:
                return self._run()
        finally:
            self.store.close()
            self.writer.close()
            if self._lock is not None:
                self._lock.close()

    def _run(self) -> dict:
        cfg, rt = self.cfg, self.rt
        self.writer.write_config(dump_config(cfg))
        self.writer.start_metrics(self.records)
        of = f" of the shard's {self.setup.info.num_clients}" if cfg.data.clients is not None else ""
        self.echo(f"fedcp_dist: {cfg.method} on {self.num_clients}{of} clients ({self.setup.info.source}), {rt.describe()}, "
                  f"{len(self.owned)} clients on rank 0, loaded in {self.setup.load_seconds:.2f} s; "
                  f"{self.setup.placement_line()}; "
                  f"training: {self.path}; {self.store_line}" + (f"; {note}" if (note := self.algo.describe()) else ""))
        for t in range(self.start_round, cfg.rounds):
            record, stop = self.round(t)
            self.writer.log(record)
            self.records.append(record)
            if stop:  # some rank got the preemption signal: every rank stops here
                self._save_checkpoint(t + 1)
                self.echo(f"checkpointed after {t + 1} rounds; exiting for requeue")
                raise Preempted(f"checkpointed after {t + 1} rounds in {cfg.out_dir}")
            # every checkpoint_every rounds, and after the last one (the final personalized models, for analysis)
            if cfg.checkpoint_every and ((t + 1) % cfg.checkpoint_every == 0 or t + 1 == cfg.rounds):
                self._save_checkpoint(t + 1)
        return self._finish()

    def round(self, t: int) -> tuple[dict, bool]:
        """Round t: evaluate (every eval_every rounds), train the cohort's owned clients, one
        all-reduce of uploads and sums, the server update (and the peer exchange). Returns the
        round's record and whether any rank was asked to stop."""
        cfg, rt = self.cfg, self.rt
        rt.phase = f"round {t + 1}"
        t_start = time.perf_counter()
        self.agg.zero()
        self.algo.begin_round(t)
        evaluated = t % cfg.eval_every == 0
        table = ProbeTable(self.num_clients) if self.probe_every else None
        probe_train = table is not None and t % self.probe_every == 0
        eval_probes = {} if table is not None and evaluated else None
        ev = self.evaluate(t, eval_probes) if evaluated else EvalSums()
        t_eval = time.perf_counter() - t_start

        cohort = self._cohort(t)
        train, bad, payloads = TrainSums(), [], {}
        cpu_start = time.process_time()
        for cid, res in self._train(t, [int(c) for c in cohort if self.owner[int(c)] == rt.rank], probe_train):
            if not res.is_finite():
                bad.append(cid)
                print(f"rank {rt.rank}: round {t + 1}: client {cid} produced a non-finite loss or update "
                      f"({'left out of the round' if cfg.on_nonfinite == 'skip' else 'stopping'})", flush=True)
                continue  # neither aggregated nor kept as the client's new state
            if probe_train:
                self._probe_training(t, cid, res, table)
            self.store.put(cid, res.client_state, res.upload)
            if self.algo.peer_dim:
                payloads[cid] = self.algo.peer_payload(res)
            if self.compressor.enabled:  # Σ n_i·Δ̂_i, added to the global state after the all-reduce
                delta, residual = self.compressor.compress(res.upload, self.global_state, self.store.residual(cid))
                self.store.put_residual(cid, residual)
                self.agg.add(delta, self.data[cid].n_train)
            else:
                self.agg.add(res.upload, self.data[cid].n_train, skip=res.skipped)
            train += TrainSums(res.loss_sum, res.samples)
        t_train, cpu_train = time.perf_counter() - t_start - t_eval, time.process_time() - cpu_start

        train += TrainSums(stop_requests=float(self.stop.signum is not None), nonfinite_clients=len(bad),
                           nonfinite_client_id_sum=sum(bad))
        if table is not None:
            table.add_evals(eval_probes or {})
            self.agg.add_extra(table.flat())
        mean, total, (train, ev) = reduce_sums(self.agg, rt, train, ev,
                                               base=self.global_state if self.compressor.enabled else None)
        if train.nonfinite_clients > 0 and cfg.on_nonfinite == "error":
            raise RunFailure(train.nonfinite_message(t))
        if total > 0:
            self.store.set_global(self.algo.server_update(self.global_state, mean))
        peer_seconds = self._exchange_peers(t, cohort, payloads) if self.algo.peer_dim else None
        seconds = time.perf_counter() - t_start
        self.round_seconds.append(seconds)
        record = {"kind": "round", "round": t + 1, "seconds": seconds, "train_seconds": t_train,
                  "train_cpu_seconds": cpu_train, "eval_seconds": t_eval, "allreduce_seconds": self.agg.last_seconds,
                  "allreduce_bytes": self.agg.nbytes,
                  **({"peer_exchange_seconds": peer_seconds} if peer_seconds is not None else {}),
                  "participants": int(len(cohort)), "train_loss": train.loss_sum / max(train.samples, 1.0),
                  "nonfinite_skipped": int(train.nonfinite_clients)}
        record.update(uplink_record(self.compressor, self.agg, self.algo.uplink_saved_params(t),
                                    len(cohort) - int(train.nonfinite_clients), len(cohort)))
        record.update(memory_record(self.store) if cfg.record_memory else {})
        if self.select_by_features:
            record["cohort"] = [int(c) for c in cohort]
        if evaluated:
            record.update({"evaluated_after": t, **ev.summary()})
            self.echo(progress_line(cfg.rounds, record, record))
        if table is not None:
            reduced = ProbeTable.from_flat(self.agg.extra(), self.num_clients)
            self.writer.log_analysis(reduced.records(t if probe_train else None, t if evaluated else None))
        return record, train.stop_requests > 0

    def _finish(self) -> dict:
        """The evaluation after the last round, final_global.pt, summary.json and the result table."""
        cfg, rt = self.cfg, self.rt
        rt.phase = "final evaluation"
        probes = {} if self.probe_every else None
        final = torch.tensor(self.evaluate(cfg.rounds, probes).values(), dtype=torch.float64)
        if probes is not None:  # the clients' evaluation probes ride in the same all-reduce
            table = ProbeTable(self.num_clients, train=False)
            table.add_evals(probes)
            final = torch.cat([final, table.flat()])
        final = rt.all_reduce_sum_(final.to(rt.device)).cpu()
        e = {"evaluated_after": cfg.rounds, **EvalSums.from_values(final[:EvalSums.size()].tolist()).summary()}
        if probes is not None:
            reduced = ProbeTable.from_flat(final[EvalSums.size():], self.num_clients, train=False)
            self.writer.log_analysis(reduced.records(None, cfg.rounds))
        self.writer.log({"kind": "final_eval", "round": cfg.rounds, **e})
        self.echo(progress_line(cfg.rounds, e, None))
        summary = run_summary(cfg, rt, self.setup.info.source, self.num_clients, self.records, e, self.round_seconds,
                              self.setup.load_seconds)
        if cfg.data.clients is not None:  # which of the shard's clients the run's 0 … K − 1 are
            summary["shard_clients"] = self.setup.clients.tolist()
        summary.update(byte_totals(self.records))
        if self.select_by_features:
            summary["selection_counts"] = selection_counts(self.records, self.num_clients)
        self.writer.save_final_global(self.global_state)
        self.writer.write_summary(summary)  # last: its presence marks a finished run
        self.echo(result_table(summary))
        return summary
