"""Personalized evaluation: its sums and micro AUC on hand-computed numbers, and the evaluation
after the last round, reduced as the rounds' are."""
import math

import numpy as np
import pytest
import torch

from helpers import Recorder
from fedcp_dist.comm.aggregate import ClientOrder, TrainSums, sums_size
from fedcp_dist.state.client_store import ClientStore
from fedcp_dist.data.resident import to_device
from fedcp_dist.engine.evaluation import EvalSums, evaluate_clients, micro_auc


CPU = torch.device("cpu")


class Fixed:
    """Predicts fixed logits per client (what a trained model would), no state."""

    def __init__(self, logits):
        self.logits = logits

    def prepare_eval(self, state, data, ctx):
        return state

    def predict(self, state, x, ctx):
        return self.logits[ctx.client][: len(x)]


def _data(cid, labels):
    n = len(labels)
    arrays = {"train_x": np.zeros((1, 1, 2, 2), np.uint8), "train_y": np.zeros(1, np.int64),
              "test_x": np.zeros((n, 1, 2, 2), np.uint8), "test_y": np.asarray(labels)}
    return to_device(cid, arrays, (0.5,), (0.5,), CPU)


def test_evaluation_sums_hand_computed():
    datas = {0: _data(0, [0, 1, 1]), 1: _data(1, [1])}
    logits = {0: torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]), 1: torch.tensor([[0.0, 0.0]])}
    store = ClientStore(Recorder(), {})
    sums = evaluate_clients(Fixed(logits), store, datas, [0, 1], 0, lambda t, c: None, batch_size=2)
    ce2 = math.log(1 + math.exp(-2))  # a confident right answer
    assert sums.correct == 2 and sums.test_samples == 4 and sums.clients == 2
    assert sums.acc_client_sum == pytest.approx(2 / 3 + 0.0)  # argmax of a tie is class 0: wrong
    assert sums.loss_sum == pytest.approx(2 * ce2 + (2 + ce2) + math.log(2))
    auc0 = micro_auc(np.array([0, 1, 1]), torch.softmax(logits[0], 1).numpy())
    assert sums.auc_weighted_sum == pytest.approx(3 * auc0 + 1 * 0.5)


def test_micro_auc_perfect_and_inverted():
    probs = np.array([[0.9, 0.1], [0.2, 0.8]])
    assert micro_auc(np.array([0, 1]), probs) == 1.0
    assert micro_auc(np.array([1, 0]), probs) == 0.0


def test_the_final_evaluation_goes_through_the_rounds_reduction(digits6, tmp_path, monkeypatch):
    """The evaluation after the last round is reduced as a round's is (reduce_sums, the round's
    aggregator), only with no upload in its buffer; its record and probes come from that reduction."""
    import json

    from conftest import REPO
    from fedcp_dist.engine import simulator
    from fedcp_dist.engine.round_record import evaluation_record
    from helpers import run

    calls, real = [], simulator.reduce_sums

    def spy(agg, rt, *sums, **kw):
        out = real(agg, rt, *sums, **kw)
        calls.append((list(agg.sent), agg.buffer.numel(), agg.num_params, out[2][-1]))
        return out

    monkeypatch.setattr(simulator, "reduce_sums", spy)
    run(str(REPO / "configs" / "digits_fedcp.yaml"),
        [f"data.path={digits6}", "rounds=2", "analysis=true", f"out_dir={tmp_path}", "threads=1"])
    assert len(calls) == 3 and all(c[0] for c in calls[:2]) and calls[2][0] == []
    (_, size, params, final_sums), clients = calls[2], 6
    assert size == (1 + sums_size(TrainSums, EvalSums) + ClientOrder.size(EvalSums, clients)
                    + clients * (6 + 3 + 50)) and params > size
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1] == {"kind": "final_eval", "round": 2, **evaluation_record(2, final_sums)}
    assert final_sums.test_samples > 0 and final_sums.clients == clients
    probes = [json.loads(l) for l in (tmp_path / "analysis.jsonl").read_text().splitlines()]
    final_probes = [p for p in probes if p.get("evaluated_after") == 2]
    assert [p["client"] for p in final_probes] == list(range(clients))
    assert sum(p["samples"] for p in final_probes) == final_sums.test_samples
