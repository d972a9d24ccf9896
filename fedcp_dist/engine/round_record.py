"""What the round loop reports: a round's record (one line of metrics.jsonl), the final
evaluation's, and the run's summary (summary.json), assembled from the round's reduced sums, its
times and the aggregator's byte counts. Rank 0's :class:`~fedcp_dist.rundir.directory.RunWriter` writes them."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from fedcp_dist.comm.aggregate import TrainSums
from fedcp_dist.comm.compress import byte_totals
from fedcp_dist.engine.evaluation import EvalSums
from fedcp_dist.comm.selection import selection_counts

#: the times of a round's record, in its order (peer_exchange_seconds only where the method exchanges models)
TIMES = ("seconds", "train_seconds", "train_cpu_seconds", "eval_seconds")


def round_record(t: int, times: dict, agg, cohort: Sequence[int], train: TrainSums, uplink: dict,
                 ev: Optional[EvalSums], with_cohort: bool, eval_clients: Optional[int] = None,
                 trained: Optional[int] = None) -> dict:
    """Round t's record (0-based t): ``times`` (:data:`TIMES`, and ``peer_exchange_seconds`` where
    there was an exchange), the all-reduce's time and size, the cohort's size and train loss from the
    reduced ``train`` sums, the byte counts ``uplink``, the cohort itself (``with_cohort``) and the
    evaluation before the round (``ev``; None: the round did not evaluate) of ``eval_clients`` clients,
    ``trained`` of which had trained by then."""
    record = {"kind": "round", "round": t + 1, **{k: times[k] for k in TIMES},
              "allreduce_seconds": agg.last_seconds, "allreduce_bytes": agg.nbytes,
              **({"peer_exchange_seconds": times["peer_exchange_seconds"]} if "peer_exchange_seconds" in times else {}),
              "participants": int(len(cohort)),
              # null where no sample was trained on (an empty Poisson cohort): no loss, not a loss of 0
              "train_loss": train.loss_sum / train.samples if train.samples > 0 else None,
              "nonfinite_skipped": int(train.nonfinite_clients), **uplink}
    if with_cohort:
        record["cohort"] = [int(c) for c in cohort]
    if ev is not None:
        record.update(evaluation_record(t, ev, eval_clients, trained))
    return record


def learned_nothing(records: list) -> bool:
    """Whether no round of the run (``records``: its metrics.jsonl lines) aggregated a single finite
    client result: every participant of every round was left out as non-finite (``on_nonfinite:
    skip``), so the global model and every client's state are still the initial ones. A round
    without participants (a Poisson cohort may be empty) says nothing either way, and a run whose
    every round was empty diverged in none."""
    trained = [r for r in records if r.get("kind") == "round" and int(r.get("participants", 0)) > 0]
    return bool(trained) and all(int(r["participants"]) <= int(r.get("nonfinite_skipped", 0)) for r in trained)


def evaluation_record(rounds_done: int, ev: EvalSums, eval_clients: Optional[int] = None,
                      trained: Optional[int] = None) -> dict:
    """An evaluation's numbers from its reduced sums: that of a round (before its training) and the
    one after the last round alike, with the number of clients it evaluated where that is a sample
    (``eval_clients``, config key ``eval_clients``; None: every client, and the key is left out) and,
    with partial participation, how many of them had been in some round's cohort by then
    (``eval_clients_trained``; ``trained`` None: every client trains each round, the key is left
    out). The others are evaluated with the state they started with."""
    out = {"evaluated_after": rounds_done, **ev.summary()}
    if eval_clients is not None:
        out["eval_clients"] = int(eval_clients)
    if trained is not None:
        out["eval_clients_trained"] = int(trained)
    return out


def summary_json(cfg, rt, setup, num_clients: int, records: list, final: dict, round_seconds: list,
                 with_selection: bool) -> dict:
    """summary.json of a finished run: the best evaluation over the rounds (the paper's reported
    number), the final one (``final``), where and how fast it ran, which of the shard's clients the
    run's 0 … K − 1 are (a run on part of a shard), the run's byte totals and, with
    feature-difference selection, the rounds each client trained in."""
    best = max([r for r in records if "acc" in r] + [final], key=lambda r: r["acc"])
    out = {
        "method": cfg.method, "source": setup.info.source, "num_clients": num_clients, "rounds": cfg.rounds,
        "best_acc": best["acc"], "best_after_rounds": best["evaluated_after"], "final_acc": final["acc"],
        "final_acc_client_mean": final["acc_client_mean"], "final_auc": final["auc"],
        "seconds_per_round": float(np.mean(round_seconds)), "world_size": rt.world_size, "launcher": rt.launcher,
        "device": str(rt.device), "load_seconds": setup.load_seconds,
        # binary tasks (two classes) only
        **{f"final_{k}": final[k] for k in ("balanced_acc", "pos_recall") if k in final},
    }
    if setup.info.fingerprint:  # copies of one shard (node-local) are one data set to fedcp-report
        out["data_fingerprint"] = setup.info.fingerprint
    if cfg.data.clients is not None:
        out["shard_clients"] = setup.clients.tolist()
    if setup.eval_ids is not None and len(setup.eval_ids) < num_clients:
        out["eval_clients"] = int(len(setup.eval_ids))  # the evaluations covered a sample (config key eval_clients)
    if "eval_clients_trained" in final:  # partial participation: how many of those the final evaluation had trained
        out["final_eval_clients_trained"] = final["eval_clients_trained"]
    out.update(byte_totals(records))
    if with_selection:
        out["selection_counts"] = selection_counts((r.get("cohort", ()) for r in records), num_clients)
    return out
