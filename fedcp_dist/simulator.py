"""The round loop. Identical control flow on every rank; one all-reduce per round.

round t:
    [every eval_every rounds] evaluate the personalized model of every owned client
    cohort = sample_cohort(seed, t)                      # same on every rank
    for each owned client in the cohort: local_train → accumulate n_i · upload
    all_reduce(SUM) of [Σ n_i·θ_i | Σ n_i | metric sums]  # the evaluation sums ride along
    global_state = server_update(global_state, Σ n_i·θ_i / Σ n_i)
"""
from __future__ import annotations

import fcntl
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedcp_dist.aggregate import FlatAggregator
from fedcp_dist.algorithms import make_algorithm
from fedcp_dist.algorithms.base import Context
from fedcp_dist.checkpoint import Checkpointer
from fedcp_dist.config import Config, dump_config, flatten
from fedcp_dist.data.resident import ClientData, to_device
from fedcp_dist.data.shards import load_clients, read_info
from fedcp_dist.errors import Preempted, RunFailure, UserError
from fedcp_dist.models import build_model
from fedcp_dist.placement import STREAM_EVAL, STREAM_TRAIN, place_clients, sample_cohort, stream_seed
from fedcp_dist.rundir import RESUMABLE_CHANGES, RUN_FILES, RunWriter, result_table  # noqa: F401 (RUN_FILES: kept importable here)
from fedcp_dist.runtime import Runtime

TRAIN_METRICS = ("train_loss_sum", "train_samples", "stop_requests", "nonfinite_clients", "nonfinite_client_id_sum")
EVAL_METRICS = ("correct", "test_samples", "acc_client_sum", "clients", "auc_weighted_sum", "loss_sum")
BN_STAT_SUFFIXES = (".running_mean", ".running_var")
BN_PREFIX = "__bn__/"  # a client's own BatchNorm statistics, inside its checkpointed state


def _finite(res) -> bool:
    """The loss, the upload and the new client state (a personal-only method uploads nothing) are finite."""
    if not math.isfinite(res.loss_sum):
        return False
    tensors = [*res.upload.values(), *(res.client_state or {}).values()]
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def _parse_injection(spec: str):
    """``FEDCP_INJECT_NONFINITE=ROUND:CLIENT`` (a testing hook): that client's upload becomes NaN."""
    if not spec:
        return None
    try:
        r, c = spec.split(":")
        return int(r), int(c)
    except ValueError:
        raise UserError(f"FEDCP_INJECT_NONFINITE={spec!r} is not ROUND:CLIENT") from None


def micro_auc(labels: np.ndarray, probs: np.ndarray) -> float:
    """Micro-averaged one-vs-rest ROC AUC: every (sample, class) pair is one binary decision."""
    from sklearn.metrics import roc_auc_score

    num_classes = probs.shape[1]
    if num_classes < 2 or len(labels) == 0:
        return float("nan")
    onehot = np.zeros_like(probs, dtype=np.int8)
    onehot[np.arange(len(labels)), labels] = 1
    return float(roc_auc_score(onehot.ravel(), probs.ravel()))


def eval_summary(sums) -> dict:
    s = dict(zip(EVAL_METRICS, sums))
    n = max(s["test_samples"], 1.0)
    return {
        "acc": s["correct"] / n,
        "acc_client_mean": s["acc_client_sum"] / max(s["clients"], 1.0),
        "auc": s["auc_weighted_sum"] / n,
        "test_loss": s["loss_sum"] / n,
    }


class Simulator:
    def __init__(self, cfg: Config, rt: Runtime, echo: Callable[[str], None] = print):
        self.cfg, self.rt = cfg, rt
        self.echo = echo if rt.is_main else (lambda *_: None)
        self._lock = None
        self._stop_signal: Optional[int] = None
        self._inject_nonfinite = _parse_injection(os.environ.get("FEDCP_INJECT_NONFINITE", ""))
        self.ckpt = Checkpointer(cfg.out_dir, rt.rank, rt.world_size, cfg.keep_checkpoints)
        err: Optional[UserError] = None
        try:
            self._prepare_out_dir()
            self.info = read_info(cfg.data.path)
            if cfg.data.num_clients and cfg.data.num_clients != self.info.num_clients:
                raise UserError(
                    f"config key 'data.num_clients' is {cfg.data.num_clients} but {cfg.data.path} holds "
                    f"{self.info.num_clients} clients"
                )
            if cfg.data.source and cfg.data.source != self.info.source:
                raise UserError(
                    f"config key 'data.source' is {cfg.data.source!r} but {cfg.data.path} holds {self.info.source!r}"
                )
            if cfg.data.input_shape is not None and list(cfg.data.input_shape) != list(self.info.input_shape):
                raise UserError(
                    f"config key 'data.input_shape' is {list(cfg.data.input_shape)} but {cfg.data.path} holds "
                    f"inputs of shape {list(self.info.input_shape)}"
                )
            self.num_clients = self.info.num_clients
            self.owner = place_clients(self.info.train_counts, rt.world_size)
            self.owned = [int(c) for c in np.flatnonzero(self.owner == rt.rank)]
            t0 = time.perf_counter()
            arrays = load_clients(cfg.data.path, self.owned)
            self.data: dict[int, ClientData] = {
                c: to_device(c, arrays[c], self.info.mean, self.info.std, rt.device) for c in self.owned
            }
            del arrays
            self.load_seconds = time.perf_counter() - t0
        except UserError as exc:
            err = exc
        self._agree(err)

        torch.manual_seed(cfg.seed)  # the same initial model on every rank
        model = build_model(cfg.model, self.info.input_shape, self.info.num_classes, vocab_size=self.info.vocab_size)
        self.algo = make_algorithm(cfg.method, cfg, model, rt.device)
        self.algo.num_clients = self.num_clients
        counts = np.bincount(self.owner, minlength=rt.world_size)
        self.peer_bytes = self._check_peer_memory(int(counts.max()))
        self.global_state = self.algo.init_global_state()
        self.algo.set_global(self.global_state)
        self.client_states: dict[int, dict] = {}
        upload = self.algo.upload_keys(self.global_state)
        #: BatchNorm running statistics stay with each client unless aggregate_bn_stats=true
        self.bn_keys = [] if cfg.aggregate_bn_stats else [k for k in upload if k.endswith(BN_STAT_SUFFIXES)]
        self.client_bn: dict[int, dict] = {}
        if self.bn_keys and cfg.fused:
            self.echo("fused=true is not used: the model's BatchNorm statistics are per client (aggregate_bn_stats=false)")
        self.agg = FlatAggregator(
            {k: self.global_state[k].shape for k in upload if k not in self.bn_keys},
            len(TRAIN_METRICS) + len(EVAL_METRICS),
            rt.device,
        )
        self.writer = RunWriter(cfg.out_dir, rt.is_main)
        self.start_round = 0
        self.records: list[dict] = []
        self.round_seconds: list[float] = []
        err = None
        try:
            self._maybe_resume()
        except UserError as exc:
            err = exc
        self._agree(err)

    # -- start-up helpers ---------------------------------------------------
    def _check_peer_memory(self, max_owned: int) -> int:
        """Bytes per rank of the method's other-client models plus the exchange buffer; refuse over budget."""
        dim = self.algo.peer_dim
        if not dim:
            return 0
        need = self.algo.peer_memory_bytes(self.num_clients) + self.rt.world_size * max_owned * (dim + 1) * 4
        budget = self.cfg.peer_memory_mb * 2**20
        if need > budget:
            raise UserError(
                f"{self.cfg.method} needs {need / 2**20:.0f} MiB per rank for other clients' models "
                f"({self.num_clients} clients, {dim} values each) but peer_memory_mb={self.cfg.peer_memory_mb:g}; "
                f"raise peer_memory_mb or use fewer clients"
            )
        return need

    def _prepare_out_dir(self) -> None:
        """Rank 0: lock out_dir, then refuse, clear (overwrite=true) or leave it for resuming."""
        if not self.rt.is_main:
            return
        cfg, out = self.cfg, Path(self.cfg.out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
            self._lock = open(out / ".lock", "a+")
        except OSError as exc:
            raise UserError(f"out_dir {out} cannot be written: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"out_dir {out} is in use by another run (lock {out / '.lock'} is held)") from None
        if cfg.overwrite:
            shutil.rmtree(self.ckpt.root, ignore_errors=True)
            for f in RUN_FILES:
                (out / f).unlink(missing_ok=True)
            return
        if (out / "summary.json").exists():
            raise UserError(f"out_dir {out} holds a finished run (summary.json); choose another out_dir or pass overwrite=true")
        if cfg.resume == "never" and (self.ckpt.exists() or (out / "metrics.jsonl").exists()):
            raise UserError(f"out_dir {out} holds an unfinished run and resume=never; use resume=auto or overwrite=true")

    def _maybe_resume(self) -> None:
        if self.cfg.resume != "auto":
            return
        d = self.ckpt.latest(warn=self.echo)
        if d is None:
            return
        rounds_done, global_state, client_states, meta = self.ckpt.load(d, self.owned, self.rt.device)

        # keys a newer version added count with their defaults
        old = {**flatten(Config().to_dict()), **flatten(meta.get("config", {}))}
        new = flatten(self.cfg.to_dict())
        for key in sorted(set(old) | set(new)):
            if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key):
                raise UserError(
                    f"config key '{key}' is {new.get(key)!r} but the checkpointed run in {self.cfg.out_dir} used "
                    f"{old.get(key)!r}; use another out_dir, or overwrite=true to start afresh"
                )
        if set(global_state) != set(self.global_state):
            raise UserError(f"checkpoint {d} does not hold this method's global state")
        self.global_state = global_state
        self.algo.set_global(self.global_state)
        for c, state in client_states.items():
            bn = {k[len(BN_PREFIX):]: v for k, v in state.items() if k.startswith(BN_PREFIX)}
            rest = {k: v for k, v in state.items() if not k.startswith(BN_PREFIX)}
            if bn:
                self.client_bn[c] = bn
            self.client_states[c] = rest if rest else None
        self.start_round = rounds_done
        self.records = meta["records"]
        self.round_seconds = meta["round_seconds"]
        self.echo(f"resuming from {d} ({rounds_done} rounds done)")

    def _save_checkpoint(self, rounds_done: int) -> None:
        self.rt.phase = f"checkpoint after round {rounds_done}"
        meta = {"records": self.records, "round_seconds": self.round_seconds, "config": self.cfg.to_dict()}
        owned_states = {
            c: {**(self.client_states.get(c) or {}), **{BN_PREFIX + k: v for k, v in self.client_bn.get(c, {}).items()}}
            for c in set(self.client_states) | set(self.client_bn)
        }
        self.ckpt.save(rounds_done, self.global_state, owned_states, meta, self._all_ok)

    def _all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (one tiny all-reduce)."""
        flag = torch.tensor([0.0 if ok else 1.0], device=self.rt.device)
        self.rt.all_reduce_sum_(flag)
        return flag.item() == 0

    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum
            print(
                f"rank {self.rt.rank}: got {signal.Signals(signum).name}; finishing the round, then checkpointing",
                flush=True,
            )

    def _install_signal_handlers(self) -> dict:
        previous = {}
        for name in {self.cfg.preempt_signal, "SIGTERM"}:
            sig = getattr(signal, name)
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (embedded use): signals stay the caller's
                pass
        return previous

    def _agree(self, err: Optional[UserError]) -> None:
        """Every rank stops if any rank failed to start, with that rank's message where it has one."""
        flag = torch.tensor([0.0 if err is None else 1.0], device=self.rt.device)
        self.rt.all_reduce_sum_(flag)
        if err is not None:
            raise err
        if flag.item() > 0:
            raise UserError("another rank failed to start (see its message)")

    # -- per-client pieces ----------------------------------------------------
    def _generator(self, *keys: int) -> torch.Generator:
        return torch.Generator(device=self.rt.device).manual_seed(stream_seed(self.cfg.seed, *keys))

    def client_state(self, cid: int):
        if cid not in self.client_states:
            self.client_states[cid] = self.algo.init_client_state(cid)
        return self.client_states[cid]

    def _use_client_bn(self, cid: int) -> None:
        """Hand the algorithm the global state with client ``cid``'s own BatchNorm statistics."""
        if self.bn_keys and cid in self.client_bn:
            self.algo.set_global({**self.global_state, **self.client_bn[cid]})
        elif self.bn_keys:
            self.algo.set_global(self.global_state)

    @torch.no_grad()
    def evaluate_owned(self, round_idx: int) -> list[float]:
        """Sums over this rank's clients of the personalized models' test metrics."""
        sums = np.zeros(len(EVAL_METRICS))
        bs = self.cfg.eval_batch_size
        for cid in self.owned:
            d = self.data[cid]
            if d.n_test == 0:
                continue
            ctx = Context(round_idx, cid, self._generator(STREAM_EVAL, round_idx, cid))
            self._use_client_bn(cid)
            state = self.algo.prepare_eval(self.client_state(cid), d, ctx)
            logits = torch.cat([self.algo.predict(state, d.test_batch(i, i + bs)[0], ctx) for i in range(0, d.n_test, bs)])
            loss = float(F.cross_entropy(logits, d.test_y, reduction="sum"))
            correct = float((logits.argmax(1) == d.test_y).sum())
            auc = micro_auc(d.test_y.cpu().numpy(), torch.softmax(logits.float(), 1).cpu().numpy())
            sums += (correct, d.n_test, correct / d.n_test, 1.0, auc * d.n_test, loss)
        return sums.tolist()

    def _train_owned(self, t: int, cids: list[int]):
        """(client, LocalResult) for this rank's participants, one by one or in fused groups."""
        items = [(self.client_state(c), self.data[c], Context(t, c, self._generator(STREAM_TRAIN, t, c))) for c in cids]
        if self.cfg.fused and not self.bn_keys and self.algo.fused_reason() is None:
            yield from zip(cids, self.algo.train_fused(items))
            return
        for c, (state, d, ctx) in zip(cids, items):
            self._use_client_bn(c)
            yield c, self.algo.local_train(state, d, ctx)

    def _exchange_peers(self, t: int, cohort, payloads: dict) -> float:
        """One all-gather of the participants' peer payloads; the algorithm updates the global state."""
        t0 = time.perf_counter()
        self.rt.phase = f"round {t + 1}: peer exchange"
        rows = max(1, int(np.bincount(self.owner[np.asarray(cohort, dtype=np.int64)], minlength=self.rt.world_size).max()))
        buf = torch.zeros(rows, self.algo.peer_dim + 1, dtype=torch.float32, device=self.rt.device)
        for i, cid in enumerate(sorted(payloads)):
            buf[i, 0] = cid + 1  # 0 marks an empty row (a left-out client, or fewer participants here)
            buf[i, 1:] = payloads[cid]
        gathered = self.rt.all_gather(buf).view(-1, self.algo.peer_dim + 1)
        tags = gathered[:, 0].long().tolist()
        peers = {tag - 1: gathered[i, 1:] for i, tag in sorted(enumerate(tags), key=lambda it: it[1]) if tag > 0}
        self.global_state = self.algo.receive_peers(t, self.global_state, peers)
        self.algo.set_global(self.global_state)
        self.rt.phase = f"round {t + 1}"
        return time.perf_counter() - t0

    # -- the loop ----------------------------------------------------------------
    def run(self) -> dict:
        previous = self._install_signal_handlers()
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.writer.close()
            if self._lock is not None:
                self._lock.close()

    def _run(self) -> dict:
        cfg, rt = self.cfg, self.rt
        self.writer.write_text("config.yaml", dump_config(cfg))
        self.writer.start_metrics(self.records)
        self.echo(
            f"fedcp_dist: {cfg.method} on {self.num_clients} clients ({self.info.source}), {rt.describe()}, "
            f"{len(self.owned)} clients on rank 0, loaded in {self.load_seconds:.2f} s"
        )
        round_seconds = self.round_seconds
        zero_eval = [0.0] * len(EVAL_METRICS)
        for t in range(self.start_round, cfg.rounds):
            rt.phase = f"round {t + 1}"
            t_start = time.perf_counter()
            self.agg.zero()
            evaluated = t % cfg.eval_every == 0
            ev = self.evaluate_owned(t) if evaluated else zero_eval
            t_eval = time.perf_counter() - t_start

            cohort = sample_cohort(cfg.seed, t, self.num_clients, cfg.participation, cfg.participation_range)
            loss_sum, samples, bad, payloads = 0.0, 0, [], {}
            cpu_start = time.process_time()
            for cid, res in self._train_owned(t, [int(c) for c in cohort if self.owner[int(c)] == rt.rank]):
                d = self.data[cid]
                if (t + 1, cid) == self._inject_nonfinite:
                    target = res.upload or res.client_state
                    first = next(iter(target))
                    target[first] = target[first] * float("nan")
                if not _finite(res):
                    bad.append(cid)
                    print(f"rank {rt.rank}: round {t + 1}: client {cid} produced a non-finite loss or update "
                          f"({'left out of the round' if cfg.on_nonfinite == 'skip' else 'stopping'})", flush=True)
                    continue  # neither aggregated nor kept as the client's new state
                if res.client_state is not None:
                    self.client_states[cid] = res.client_state
                if self.bn_keys:
                    self.client_bn[cid] = {k: res.upload.pop(k) for k in self.bn_keys}
                if self.algo.peer_dim:
                    payloads[cid] = self.algo.peer_payload(res)
                self.agg.add(res.upload, d.n_train)
                loss_sum += res.loss_sum
                samples += res.samples
            t_train = time.perf_counter() - t_start - t_eval
            cpu_train = time.process_time() - cpu_start

            stop = 0.0 if self._stop_signal is None else 1.0
            self.agg.add_metrics([loss_sum, samples, stop, len(bad), sum(bad), *ev])
            mean, total, sums = self.agg.reduce(rt)
            if sums[3] > 0 and cfg.on_nonfinite == "error":
                who = f"client {int(sums[4])}" if sums[3] == 1 else f"{int(sums[3])} clients"
                raise RunFailure(
                    f"round {t + 1}: {who} produced a non-finite loss or update (on_nonfinite=error); the global "
                    f"model was not updated and the last complete checkpoint is kept; on_nonfinite=skip leaves such "
                    f"clients out of their round"
                )
            if total > 0:
                self.global_state = self.algo.server_update(self.global_state, mean)
                self.algo.set_global(self.global_state)
            peer_seconds = self._exchange_peers(t, cohort, payloads) if self.algo.peer_dim else 0.0
            seconds = time.perf_counter() - t_start
            round_seconds.append(seconds)
            record = {
                "kind": "round",
                "round": t + 1,
                "seconds": seconds,
                "train_seconds": t_train,
                "train_cpu_seconds": cpu_train,
                "eval_seconds": t_eval,
                "allreduce_seconds": self.agg.last_seconds,
                "allreduce_bytes": self.agg.nbytes,
                **({"peer_exchange_seconds": peer_seconds} if self.algo.peer_dim else {}),
                "participants": int(len(cohort)),
                "train_loss": sums[0] / max(sums[1], 1.0),
                "nonfinite_skipped": int(sums[3]),
            }
            if evaluated:
                e = {"evaluated_after": t, **eval_summary(sums[len(TRAIN_METRICS) :])}
                record.update(e)
                self._progress(t, e, record)
            self.writer.log(record)
            self.records.append(record)
            if sums[2] > 0:  # some rank got the preemption signal: every rank stops here
                self._save_checkpoint(t + 1)
                self.echo(f"checkpointed after {t + 1} rounds; exiting for requeue")
                raise Preempted(f"checkpointed after {t + 1} rounds in {cfg.out_dir}")
            if cfg.checkpoint_every and (t + 1) % cfg.checkpoint_every == 0 and t + 1 < cfg.rounds:
                self._save_checkpoint(t + 1)

        # final evaluation, after the last round
        rt.phase = "final evaluation"
        final = torch.tensor(self.evaluate_owned(cfg.rounds), dtype=torch.float64, device=rt.device)
        rt.all_reduce_sum_(final)
        e = {"evaluated_after": cfg.rounds, **eval_summary(final.tolist())}
        self.writer.log({"kind": "final_eval", "round": cfg.rounds, **e})
        self._progress(cfg.rounds, e, None)

        evals = [r for r in self.records if "acc" in r] + [e]
        best = max(evals, key=lambda r: r["acc"])
        summary = {
            "method": cfg.method,
            "source": self.info.source,
            "num_clients": self.num_clients,
            "rounds": cfg.rounds,
            "best_acc": best["acc"],
            "best_after_rounds": best["evaluated_after"],
            "final_acc": e["acc"],
            "final_acc_client_mean": e["acc_client_mean"],
            "final_auc": e["auc"],
            "seconds_per_round": float(np.mean(round_seconds)),
            "world_size": rt.world_size,
            "launcher": rt.launcher,
            "device": str(rt.device),
            "load_seconds": self.load_seconds,
        }
        self.writer.save_tensors("final_global.pt", self.global_state)
        self.writer.write_json("summary.json", summary)  # last: its presence marks a finished run
        self.echo(result_table(summary))
        return summary

    def _progress(self, t: int, e: dict, record: Optional[dict]) -> None:
        tail = f"  {record['seconds']:.2f} s/round  train loss {record['train_loss']:.4f}" if record else "  (final)"
        self.echo(
            f"[eval after {t:>4}/{self.cfg.rounds} rounds] acc {e['acc']:.4f}  client-mean {e['acc_client_mean']:.4f}  "
            f"auc {e['auc']:.4f}{tail}"
        )
