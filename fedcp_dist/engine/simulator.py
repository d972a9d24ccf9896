"""The round loop. Identical control flow on every rank; one all-reduce per round (and, with
feature-difference client selection, one before it that gathers the client vectors).

The pieces it wires, made by :mod:`run_start`: :mod:`startup` (shard, placement, loading, the
start line), :mod:`client_store` (per-client state), :mod:`training` (the owned participants' training and
uploads), :mod:`evaluation`, :mod:`aggregate` (the one all-reduce and the peer exchange),
:mod:`compress` (compressed uploads, byte counts), :mod:`probes` (``analysis: true``),
:mod:`round_record` (what a round and the run report), :mod:`checkpoint` (and resume) and
:mod:`rundir` (what rank 0 writes).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
import torch

from fedcp_dist.capabilities import PeerExchange, Probes, supports
from fedcp_dist.engine import startup
from fedcp_dist.rundir.code import code_digest
from fedcp_dist.comm.aggregate import ClientOrder, TrainSums, exchange_peers, reduce_sums
from fedcp_dist.rundir.checkpoint import Checkpointer
from fedcp_dist.state.process_memory import memory_record
from fedcp_dist.comm.compress import uplink_record
from fedcp_dist.config import Config, dump_config
from fedcp_dist.errors import Preempted, RunFailure
from fedcp_dist.engine.evaluation import EvalSums, evaluate_clients
from fedcp_dist.rundir.faults import fault_point
from fedcp_dist.state.placement import POISSON_TAIL, STREAM_EVAL, partial_participation
from fedcp_dist.rundir.preemption import StopSignals, interrupt_after
from fedcp_dist.comm.privacy import PrivacySums
from fedcp_dist.engine.probes import RoundProbes
from fedcp_dist.engine.round_record import evaluation_record, learned_nothing, round_record, summary_json
from fedcp_dist.rundir.directory import DIVERGED, SUMMARY, RunDir
from fedcp_dist.engine.heartbeat import Heartbeat
from fedcp_dist.fused.groups import one_thread_each, run_in_workers
from fedcp_dist.rundir.present import progress_line, result_table
from fedcp_dist.engine.run_start import close_parts, run_data_record, start_run
from fedcp_dist.runtime import Runtime
from fedcp_dist.comm.selection import draw_cohort, gather_client_vectors


class Simulator:
    """One run on this rank. ``wrap`` (for tests) wraps the algorithm the config names. ``stop``: the
    preemption signals, listened to since before start-up (:func:`fedcp_dist.run.run_config`); by
    default they are listened to while :meth:`run` runs."""

    def __init__(self, cfg: Config, rt: Runtime, echo: Callable[[str], None] = print, wrap: Callable = None,
                 stop: StopSignals = None):
        self.cfg, self.rt = cfg, rt
        #: rank 0's lines, and one while a phase other than a round's training goes long without one
        self.heartbeat = Heartbeat(echo, lambda: rt.phase).start() if rt.is_main else None
        self.echo = self.heartbeat.echo if self.heartbeat else (lambda *_: None)
        self.stop = stop if stop is not None else StopSignals(rt.rank, (cfg.preempt_signal, "SIGTERM"))
        self.ckpt = Checkpointer(cfg.out_dir, rt.rank, rt.world_size, cfg.keep_checkpoints)
        try:
            p = start_run(cfg, rt, self.ckpt, self.echo, wrap)  # closes what it made if it fails
        except BaseException:
            self._quiet()
            raise
        self.ckpt.out_dir_made()  # rank 0 made out_dir: no checkpoint of any rank makes it again
        self.setup, self.algo, self.store, self.store_line, self.writer, self._lock = (
            p.setup, p.algo, p.store, p.store_line, p.writer, p.lock)
        self.num_clients, self.owner, self.owned, self.data = (
            p.setup.num_clients, p.setup.owner, p.setup.owned, p.setup.data)
        self.fused, self.path, self.agg, self.compressor, self.trainer = p.fused, p.path, p.agg, p.compressor, p.trainer
        #: dp=central's mechanism (None: off)
        self.dp = p.dp
        self.start_round, self.records, self.round_seconds = p.start_round, p.records, p.round_seconds
        self.idle_keys, self.memory, self.disk = p.idle_keys, p.memory, p.disk
        #: what set the rounding of this run's training (:func:`startup.arithmetic`), for the checkpoints
        self.arithmetic = p.arithmetic
        #: the clients every evaluation evaluates (eval_clients), and this rank's of them
        self.eval_ids = p.setup.eval_ids
        self.eval_owned = p.setup.owned_eval(rt.rank)
        #: what an evaluation's record says it covered: the sample's size, None when every client
        self.eval_count = len(self.eval_ids) if len(self.eval_ids) < self.num_clients else None
        #: the run's clients' training samples (what a cohort is drawn by), taken once
        self.train_counts = p.setup.info.train_counts[p.setup.clients]
        #: rounds between training probes (0: analysis off); their rows ride at the end of the all-reduce
        self.probe_every = cfg.probe_every
        self.probe_layout = self.algo.probe_layout if supports(self.algo, Probes) else None
        #: the method's peer exchange (None: it has none)
        self.exchange = self.algo if supports(self.algo, PeerExchange) else None
        self.select_by_features = cfg.client_selection == "feature_difference"
        #: evaluations on one intra-op thread, as the fused groups train (:meth:`evaluate`)
        self.eval_one_thread = bool(self.fused and self.setup.groups is not None
                                    and one_thread_each(cfg, rt.device, torch.get_num_threads()))
        #: with partial participation, which of the run's clients some round's cohort has held so far: an
        #: evaluation then says how many of the clients it evaluated have ever trained (at 10^5 clients
        #: and a cohort of 100, most have not, and their personalized accuracy is the untrained one)
        self.trained = self._cohorts_so_far() if partial_participation(cfg) else None

    @property
    def global_state(self):
        return self.store.global_state

    def _cohorts_so_far(self) -> np.ndarray:
        """Which clients the cohorts of the rounds already done (a resume) held: drawn again from the
        rounds' streams, or read from the records where feature-difference selection drew them."""
        trained = np.zeros(self.num_clients, dtype=bool)
        if self.select_by_features:
            for r in self.records:
                if r.get("kind") == "round":
                    trained[np.asarray(r.get("cohort", ()), dtype=np.int64)] = True
            return trained
        for t in range(self.start_round):
            trained[self._cohort(t)] = True
        return trained

    def _trained_of(self, ids) -> Optional[int]:
        """How many of the clients ``ids`` have trained so far (None: every client trains each round)."""
        return None if self.trained is None else int(self.trained[np.asarray(ids, dtype=np.int64)].sum())

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(self, rounds_done: int) -> None:
        self.rt.phase = f"checkpoint after round {rounds_done}"
        meta = {"records": self.records, "round_seconds": self.round_seconds, "config": self.cfg.to_dict(),
                "data": run_data_record(self.cfg, self.setup), "arithmetic": self.arithmetic, "code": code_digest()}
        if self.dp is not None:
            meta["privacy"] = self.dp.state_dict()
        self.ckpt.save(rounds_done, self.global_state, self.store.checkpoint_part(), meta,
                       lambda ok: startup.all_ok(self.rt, ok))

    # -- one round's pieces --------------------------------------------------------------------
    def evaluate(self, round_idx: int, probes: RoundProbes = None, order: ClientOrder = None,
                 stoppable: bool = False) -> EvalSums:
        """This rank's sums of its clients' personalized test metrics (and, into ``probes``, their
        evaluation probes; into ``order``, each client's own values). ``stoppable``: a preemption
        signal ends it before its next client (a round's evaluation, which :meth:`round` then
        discards)."""
        fault_point("eval", round_idx + 1)  # the fault tests' hook
        self.store.prefetch(self.eval_owned)

        def job() -> EvalSums:
            return evaluate_clients(self.algo, self.store, self.data, self.eval_owned, round_idx,
                                    lambda t, c: self.trainer.generator(STREAM_EVAL, t, c), self.cfg.eval_batch_size,
                                    probes, order, progress=self.echo if self.rt.is_main else None,
                                    stop=(lambda: self.stop.signum is not None) if stoppable else None)

        # where the fused groups train on one intra-op thread each (a CPU rank of several threads), the
        # evaluation does too: on the rank's threads its sums rounded with the thread count, so a run's
        # metrics changed with the world size (one rank of 2 threads against 2 of 1) though its models did not
        return run_in_workers([job], one_thread=self.eval_one_thread)[0]

    def _cohort(self, t: int):
        """Round t's sorted cohort: uniform, or drawn by feature difference when ρ < 1."""
        return draw_cohort(self.cfg, t, self.train_counts,
                           lambda: gather_client_vectors(self.rt, self.algo, self.store, self.owned, self.num_clients))

    def _dp_line(self) -> str:
        """dp=central's part of the start line: the mechanism, its ε after the planned rounds and what it covers."""
        if self.dp is None:
            return ""
        uploads, keeps = self.algo.privacy_coverage(self.cfg)
        return self.dp.describe(self.cfg.rounds, uploads, keeps, self.agg.num_params)

    def _exchange_peers(self, t: int, cohort, payloads: dict) -> float:
        """One all-gather of the participants' peer payloads; the algorithm updates the global state."""
        t0 = time.perf_counter()
        self.rt.phase = f"round {t + 1}: peer exchange"
        peers = exchange_peers(self.rt, self.owner, cohort, payloads, self.exchange.peer_dim)
        self._check_banks(sorted(peers))  # the rows about to be replaced were read this round
        self.store.set_global(self.exchange.receive_peers(t, self.global_state, peers))
        self.rt.phase = f"round {t + 1}"
        return time.perf_counter() - t0

    def _check_banks(self, rows=None) -> None:
        """With per-client banks in files (FedAMP, FedFomo, ``client_state: disk``): stop every rank
        in one line when a rank's bank file changed on disk since the run wrote it (in ``rows``, or
        anywhere), rather than train on, checkpoint or report what was read from it."""
        if not getattr(self.store, "mapped_keys", ()):
            return
        problem = self.store.bank_problem(rows)
        if not startup.all_ok(self.rt, problem is None):
            raise RunFailure(f"rank {self.rt.rank}: {problem}" if problem else
                             "another rank's per-client bank file changed on disk since the run wrote it (its line "
                             "names it): run the same command again to resume from the newest checkpoint")

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Every round from the first not yet done, checkpoints, then the final evaluation; the summary.

        An I/O error that no part turned into a one-line failure becomes one here, naming this rank,
        what it was doing and the file. After a failure the store, the writer and the out_dir lock
        are still closed, and the first failure is the one raised."""
        try:
            with self.stop:
                summary = self._run()
        except OSError as exc:
            self._close(failed=True)
            where = f"{exc.filename}: " if exc.filename else ""
            raise RunFailure(f"rank {self.rt.rank}, {self.rt.phase}: {where}{exc.strerror or exc}") from None
        except BaseException:
            self._close(failed=True)
            raise
        self._close(failed=False)
        return summary

    def _close(self, failed: bool) -> None:
        """Close the store (its writes end, its folder is released), the writer and the out_dir lock,
        each even when one before it fails; the first error is raised unless the run has ``failed``."""
        self._quiet()
        close_parts((self.store, self.data, self.writer, self._lock), failed)

    def _quiet(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def _run(self) -> dict:
        cfg, rt = self.cfg, self.rt
        if not startup.all_ok(rt, self.stop.signum is None):  # a signal during start-up, on any rank
            self.echo(f"asked to stop before round {self.start_round + 1}; exiting with status 75 "
                      f"(nothing new to checkpoint)")
            raise Preempted(f"stopped during start-up, before round {self.start_round + 1}, in {cfg.out_dir}",
                            nothing_new=True)
        self.stop.stage = "rounds"  # a signal from here finishes the round (or stops its evaluation)
        lost = RunDir(cfg.out_dir).lines_recorded() if rt.is_main and self.start_round == 0 else 0
        if lost:  # a run stopped before its first complete checkpoint: what it recorded cannot be resumed
            self.echo(f"note: {cfg.out_dir} held {lost} record{'s' if lost > 1 else ''} (metrics.jsonl) of a run stopped before "
                      f"its first complete checkpoint (checkpoint_every={cfg.checkpoint_every}): nothing to resume "
                      f"from, so this run starts at round 1 and its records replace those")
        self.writer.write_config(dump_config(cfg), fresh=self.start_round == 0)
        self.writer.start_metrics(self.records)
        self.echo(startup.start_line(cfg, rt, self.setup, self.path, self.store_line,
                                     "; ".join(n for n in (self.algo.describe(), self._dp_line()) if n),
                                     self.idle_keys))
        self.echo(self.memory)
        if self.disk:
            self.echo(self.disk)
        checkpointed = self.start_round if self.start_round else None  # the round of the newest checkpoint
        for t in range(self.start_round, cfg.rounds):
            record, stop = self.round(t)
            if record is None:  # asked to stop during round t + 1's evaluation: the rounds done are t
                self._stop_before_training(t, checkpointed)
            self.writer.log(record)
            self.records.append(record)
            if self.heartbeat is not None:  # the rounds' pace is known from here
                self.heartbeat.round_done()
            if stop:  # some rank got the preemption signal: every rank stops here
                self._save_checkpoint(t + 1)
                rounds = f"{t + 1} round{'s' if t > 0 else ''}"
                self.echo(f"checkpointed after {rounds}; exiting with status 75 (the same command resumes)")
                raise Preempted(f"checkpointed after {rounds} in {cfg.out_dir}")
            # every checkpoint_every rounds, and after the last one (the final personalized models, for analysis)
            if cfg.checkpoint_every and ((t + 1) % cfg.checkpoint_every == 0 or t + 1 == cfg.rounds):
                self._save_checkpoint(t + 1)
                checkpointed = t + 1
        return self._finish(checkpointed)

    def _stop_before_training(self, t: int, checkpointed: Optional[int]) -> None:
        """A preemption signal during round t + 1's evaluation (t = rounds: the final one): the
        state is that after t rounds, checkpointed unless the newest checkpoint holds it already
        (after no round: nothing to keep); then :class:`Preempted`."""
        cfg = self.cfg
        which = "the final evaluation" if t == cfg.rounds else f"round {t + 1}'s evaluation"
        if t == 0:
            self.echo("asked to stop during round 1's evaluation; exiting with status 75 (nothing to checkpoint)")
            raise Preempted(f"stopped during round 1's evaluation, before any training, in {cfg.out_dir}",
                            nothing_new=True)
        if checkpointed != t:
            self._save_checkpoint(t)
        rounds = f"{t} round{'s' if t > 1 else ''}"
        self.echo(f"asked to stop during {which}; "
                  f"{'checkpointed' if checkpointed != t else 'the newest checkpoint is'} after {rounds}; exiting with status 75 (the same command resumes)")
        raise Preempted(f"checkpointed after {rounds} in {cfg.out_dir} ({which} stopped)",
                        nothing_new=t == self.start_round)

    def round(self, t: int) -> tuple[Optional[dict], bool]:
        """Round t: evaluate (every eval_every rounds), train the cohort's owned clients, one
        all-reduce of uploads, sums and probes, the server update (and the peer exchange). Returns
        the round's record and whether any rank was asked to stop; (None, True) when a rank was
        asked to stop during the evaluation (the round is not trained)."""
        cfg, rt = self.cfg, self.rt
        rt.phase = f"round {t + 1}"
        t_start = time.perf_counter()
        self.algo.begin_round(t)
        evaluated = t % cfg.eval_every == 0
        probes = RoundProbes(self.probe_every, self.setup.max_cohort, t, evaluated, self.probe_layout,
                             eval_ids=self.eval_ids)
        # the sums of per-client fractions are taken in client order (the same bits on any world size)
        ev_order = ClientOrder(EvalSums, len(self.eval_ids), ids=self.eval_ids) if evaluated else None
        ev = self.evaluate(t, probes, ev_order, stoppable=True) if evaluated else EvalSums()
        t_eval = time.perf_counter() - t_start
        # a preemption signal during the evaluation (10^5 clients take minutes, more than a scheduler's
        # warning may leave for the round and its checkpoint): every rank stops before training, the
        # round not begun, its evaluation discarded (it leaves every state as it was: a resume evaluates
        # the round again, the same bits)
        if evaluated and not startup.all_ok(rt, self.stop.signum is None):
            return None, True

        trained = self._trained_of(self.eval_ids) if evaluated else None  # before this round's cohort trains
        cohort = self._cohort(t)
        if len(cohort) > self.setup.max_cohort > 0:  # a Poisson draw past its bound (a chance of 10^-20 a round)
            raise RunFailure(f"round {t + 1} drew a Poisson cohort of {len(cohort)} clients, more than the "
                             f"{self.setup.max_cohort} its per-client rows were sized for (a chance below "
                             f"{POISSON_TAIL:g} a round): start the run again with another seed")
        if self.trained is not None:
            self.trained[np.asarray(cohort, dtype=np.int64)] = True
        probes.set_cohort(cohort)
        if self.dp is not None:
            self.dp.begin_round()
        train_order = ClientOrder(TrainSums, len(cohort))
        self.agg.begin_round(self.algo.skipped_groups(t), train_order.values.numel()
                             + (ev_order.values.numel() if ev_order is not None else 0))
        cpu_start = time.process_time()
        fault_point("train", t + 1)  # the fault tests' hook
        train, payloads = self.trainer.train(t, cohort, probes, train_order)
        times = {"train_seconds": time.perf_counter() - t_start - t_eval,
                 "train_cpu_seconds": time.process_time() - cpu_start, "eval_seconds": t_eval}

        train += TrainSums(stop_requests=float(self.stop.signum is not None))
        if probes.on:
            self.agg.add_extra(probes.pack())
        dp = self.dp
        mean, total, (train, ev, *dp_sums) = reduce_sums(
            self.agg, rt, train, ev, *((dp.local,) if dp else ()),
            base=self.global_state if self.compressor.enabled or dp else None, orders=(train_order, ev_order),
            privatize=dp.privatizer(t) if dp else None)
        if train.nonfinite_clients > 0 and cfg.on_nonfinite == "error":
            raise RunFailure(train.nonfinite_message(t) + (dp.nonfinite_hint() if dp else ""))
        if total > 0 or dp:  # with DP the noised mean is released whoever trained
            self.store.set_global(self.algo.server_update(self.global_state, mean))
        if self.exchange is not None:
            times["peer_exchange_seconds"] = self._exchange_peers(t, cohort, payloads)
        times["seconds"] = time.perf_counter() - t_start
        self.round_seconds.append(times["seconds"])
        uplink = uplink_record(self.compressor, self.agg, len(cohort) - int(train.nonfinite_clients), len(cohort))
        record = round_record(t, times, self.agg, cohort, train, uplink, ev if evaluated else None,
                              self.select_by_features, self.eval_count, trained)
        record.update(dp.end_round(t, dp_sums[0]) if dp else {})
        record.update(memory_record(self.store) if cfg.record_memory else {})
        if evaluated:
            self.echo(progress_line(cfg.rounds, record, record))
        self.writer.log_analysis(probes.records(self.agg.extra()))
        return record, train.stop_requests > 0

    def _finish(self, checkpointed: Optional[int]) -> dict:
        """The evaluation after the last round, final_global.pt, summary.json and the result table.
        A preemption signal during that evaluation (10^5 clients: minutes, past a scheduler's grace)
        stops it as a round's: the rounds are checkpointed unless ``checkpointed`` (the newest
        checkpoint's round) holds them, exit 75, and the restart evaluates again.

        A run in which no round aggregated a finite client result (every update non-finite and left
        out: ``on_nonfinite: skip``) learned nothing: its summary says ``"status": "diverged"`` and it
        ends with a one-line :class:`RunFailure`, so that neither its exit status nor a sweep or
        report takes the untrained model's accuracy for a result."""
        cfg, rt = self.cfg, self.rt
        rt.phase = "final evaluation"
        self.stop.stage = "final"  # a signal from here stops the evaluation (the restart does it again)
        self._check_banks()  # the rounds since the last checkpoint read them
        probes = RoundProbes(self.probe_every, self.setup.max_cohort, cfg.rounds, evaluated=True,
                             layout=self.probe_layout, final=True, eval_ids=self.eval_ids)
        # the rounds' reduction, with no upload in the buffer: the sums (per-client fractions in client
        # order) and probes of a round without training
        order = ClientOrder(EvalSums, len(self.eval_ids), ids=self.eval_ids)
        ev = self.evaluate(cfg.rounds, probes, order, stoppable=True)
        if not startup.all_ok(rt, self.stop.signum is None):
            self._stop_before_training(cfg.rounds, checkpointed)
        self.stop.stage = "writing"  # a signal from here is too late to stop anything: the run finishes
        self.agg.begin_round(rows=order.values.numel(), uploads=False)
        if probes.on:
            self.agg.add_extra(probes.pack())
        _, _, (_, ev, *_) = reduce_sums(self.agg, rt, TrainSums(), ev, *((PrivacySums(),) if self.dp else ()),
                                        orders=(None, order))
        e = evaluation_record(cfg.rounds, ev, self.eval_count, self._trained_of(self.eval_ids))
        self.writer.log_analysis(probes.records(self.agg.extra()))
        self.writer.log({"kind": "final_eval", "round": cfg.rounds, **e})
        self.echo(progress_line(cfg.rounds, e, None))
        summary = summary_json(cfg, rt, self.setup, self.num_clients, self.records, e, self.round_seconds,
                              self.select_by_features)
        if self.dp is not None:
            summary.update(self.dp.summary(cfg.rounds))
        diverged = learned_nothing(self.records)
        if diverged:
            summary["status"] = DIVERGED
        rt.phase = "writing final_global.pt and summary.json"
        with interrupt_after(deliver=False):  # a Ctrl-C now: both files written whole, the run finished
            self.writer.save_final_global(self.global_state)
            fault_point("final")  # the fault tests' hook
            self.writer.write_summary(summary)  # last: its presence marks a finished run
        self.echo(result_table(summary))
        if diverged:
            raise RunFailure(f"the run learned nothing: every client's update was non-finite in each of its {cfg.rounds} "
                             f"rounds and on_nonfinite=skip left them all out, so its model is the untrained one"
                             f"{' plus the noise DP added to it' if self.dp is not None and self.dp.plan.sigma > 0 else ''} "
                             f"(accuracy {summary['final_acc']:.4f}); {cfg.out_dir}/{SUMMARY} marks it diverged (a "
                             f"lower lr?)")
        return summary
