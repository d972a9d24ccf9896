"""How a run and its values are shown: the names of config values in folder names and report
labels, the progress line of an evaluation, the table a finished run prints."""
from __future__ import annotations

import math
from typing import Any, Optional

from fedcp_dist.rundir.directory import DIVERGED


def format_value(value: Any) -> str:
    """A config value as a run directory name and a report label show it.

    Exact and stable, since sweep directory and shard names are made of it: floats as Python's
    shortest round-trip form (``0.1``, ``1e-05``, ``1.0``), lists joined by ``-`` (``0.1-0.2``;
    ``empty``), booleans and null as YAML writes them.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "-".join(format_value(v) for v in value) or "empty"
    if value is None:
        return "null"
    return str(value)


def progress_line(rounds: int, e: dict, record: Optional[dict]) -> str:
    """The line printed for an evaluation (``record``: its round's record; None: the final one).

    A round evaluates the model it starts from, then trains (as the reference library does), so a
    round's line puts the evaluation before the round's own figures and says so:
    ``[round 1/3] before training: acc … | round 54.78 s (training 52.10 s), train loss 1.80, ε 3.45``
    (the round's time holds its evaluation, which at scale can outlast the training); the final one
    is ``[final] after round 3: acc …``."""
    metrics = (f"acc {e['acc']:.4f}  client-mean {e['acc_client_mean']:.4f}  auc {e['auc']:.4f}"
               + (f"  bal-acc {e['balanced_acc']:.4f}  pos-recall {e['pos_recall']:.4f}" if "balanced_acc" in e else ""))
    if not record:
        return f"[final] after round {e['evaluated_after']}: {metrics}"
    loss = record.get("train_loss")
    training = f" (training {record['train_seconds']:.2f} s)" if "train_seconds" in record else ""
    tail = (f" | round {record['seconds']:.2f} s{training}, train loss "
            + (f"{loss:.4f}" if loss is not None else "n/a (no client trained)"))
    if "dp_epsilon" in record:  # dp=central: ε after this round (a larger cohort's noise: not this run's)
        eps = record["dp_epsilon"]
        tail += ", ε " + (f"{eps:.3g}" if math.isfinite(eps) else "∞")
        tail += " (noise of a larger cohort: no guarantee here)" if record.get("dp_guarantee") is False else ""
    width = len(str(rounds))
    return f"[round {record['round']:>{width}}/{rounds}] before training: {metrics}{tail}"


def _percent(v, undefined: str) -> str:
    """A share as a percentage; NaN (a rate over no sample) as "undefined" and why."""
    return f"{100 * v:.2f} %" if isinstance(v, (int, float)) and math.isfinite(v) else f"undefined ({undefined})"


def result_table(s: dict) -> str:
    """The table a finished run prints: method, data, ranks, accuracies and time per round."""
    rows = [
        ("method", s["method"]),
        ("data", f"{s['source']}, {s['num_clients']} clients"),
        ("ranks", f"{s['world_size']} ({s['launcher']}, {s['device']})"),
        ("rounds", s["rounds"]),
        *([("status", "DIVERGED: no round aggregated a finite update; the untrained model's accuracies")]
          if s.get("status") == DIVERGED else []),
        ("best accuracy", f"{100 * s['best_acc']:.2f} %  (after {s['best_after_rounds']} rounds)"),
        ("final accuracy", f"{100 * s['final_acc']:.2f} %"),
        ("final accuracy, client mean", f"{100 * s['final_acc_client_mean']:.2f} %"),
        ("final micro AUC", f"{s['final_auc']:.4f}"),
        *([("final balanced accuracy", _percent(s["final_balanced_acc"], "a class absent from the test splits")),
           ("final positive-class recall", _percent(s["final_pos_recall"], "no positive test sample"))]
          if "final_balanced_acc" in s else []),
        *([("evaluated clients trained", f"{s['final_eval_clients_trained']:,} of {s.get('eval_clients', s['num_clients']):,}")]
          if "final_eval_clients_trained" in s else []),
        ("seconds per round", f"{s['seconds_per_round']:.3f}"),
    ]
    if "dp_epsilon" in s:  # dp=central: the budget spent, and whether it is this run's guarantee
        eps = s["dp_epsilon"]
        rows.append(("DP (ε, δ)", f"({eps:.4g}, {s['dp_delta']:g})" if math.isfinite(eps) else
                     f"(∞, {s['dp_delta']:g}): no noise"))
        if "dp_noise_cohort_size" in s:
            rows.append(("DP guarantee", "none for this run (noise of a cohort of "
                                         f"{s['dp_noise_cohort_size']:g})"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 32)
    return "\n".join([line, *[f"{k:<{width}}  {v}" for k, v in rows], line])
