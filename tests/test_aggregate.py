"""The round's one all-reduce on hand-computed numbers: the sample-weighted average (one rank,
and split over two), the named sums that ride along, and the round's record built from them."""
import pytest
import torch

from helpers import FakeRuntime
from fedcp_dist.comm.aggregate import FlatAggregator, TrainSums, reduce_sums, sums_size
from fedcp_dist.engine.evaluation import EvalSums


CPU = torch.device("cpu")


def test_weighted_average_hand_computed():
    spec = {"w": torch.Size([2]), "b": torch.Size([])}
    agg = FlatAggregator(spec, num_metrics=1, device=torch.device("cpu"))
    agg.add({"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}, weight=1)
    agg.add({"w": torch.tensor([4.0, 8.0]), "b": torch.tensor(0.0)}, weight=3)
    agg.add_metrics([5.0])
    mean, total, metrics = agg.reduce(FakeRuntime())
    assert total == 4
    assert mean["w"].tolist() == pytest.approx([(1 + 12) / 4, (2 + 24) / 4])
    assert mean["b"].item() == pytest.approx(3 / 4)
    assert metrics == [5.0]
    assert agg.nbytes == (3 + 1 + 1) * 8


def test_weighted_average_split_over_ranks_equals_one_rank():
    spec = {"w": torch.Size([3])}
    ups = [(torch.tensor([1.0, 0.0, 2.0]), 5), (torch.tensor([3.0, 1.0, 1.0]), 2), (torch.tensor([0.0, 4.0, 4.0]), 1)]
    one = FlatAggregator(spec, 0, torch.device("cpu"))
    for u, n in ups:
        one.add({"w": u}, n)
    m1, t1, _ = one.reduce(FakeRuntime())
    a, b = FlatAggregator(spec, 0, torch.device("cpu")), FlatAggregator(spec, 0, torch.device("cpu"))
    a.add({"w": ups[0][0]}, ups[0][1])
    b.add({"w": ups[1][0]}, ups[1][1])
    b.add({"w": ups[2][0]}, ups[2][1])
    ranks = FakeRuntime(2, others=[b.buffer])  # rank 1's buffer, added in a's all-reduce
    m2, t2, _ = a.reduce(ranks)
    assert t1 == t2 == 8
    assert torch.allclose(m1["w"], m2["w"])
    assert m1["w"].tolist() == pytest.approx([(5 + 6 + 0) / 8, (0 + 2 + 4) / 8, (10 + 2 + 4) / 8])


def test_round_sums_travel_by_name():
    agg = FlatAggregator({"w": torch.Size([2])}, sums_size(TrainSums, EvalSums), CPU)
    agg.add({"w": torch.tensor([1.0, 3.0])}, 2)
    train = TrainSums(loss_sum=4.5, samples=9)
    train += TrainSums(loss_sum=0.5, samples=1, nonfinite_clients=1, nonfinite_client_id_sum=7)
    ev = EvalSums(correct=3, test_samples=4, acc_client_sum=0.75, clients=1, auc_weighted_sum=2.0, loss_sum=1.2)
    # the other rank: one client of weight 1 with w = (5, 5), and its own sums
    other = torch.zeros_like(agg.buffer)
    other[:2] = torch.tensor([5.0, 5.0])
    other[2] = 1.0
    other[3:] = torch.tensor(TrainSums(1.0, 2.0, 1.0).values() + EvalSums(1, 4, 0.25, 1, 3.0, 2.0).values(),
                             dtype=other.dtype)
    mean, total, (t, e) = reduce_sums(agg, FakeRuntime(2, others=[other]), train, ev)
    assert total == 3 and mean["w"].tolist() == pytest.approx([(2 + 5) / 3, (6 + 5) / 3])
    assert (t.loss_sum, t.samples, t.stop_requests, t.nonfinite_clients, t.nonfinite_client_id_sum) == (6.0, 12.0, 1.0, 1.0, 7.0)
    assert e == EvalSums(4, 8, 1.0, 2, 5.0, 3.2)
    assert e.summary() == pytest.approx({"acc": 0.5, "acc_client_mean": 0.5, "auc": 5 / 8, "test_loss": 0.4})


def test_sums_refuse_a_wrong_length():
    with pytest.raises(AssertionError):
        EvalSums.from_values([1.0, 2.0])


def test_round_record_by_hand():
    from fedcp_dist.comm.aggregate import TrainSums
    from fedcp_dist.engine.evaluation import EvalSums
    from fedcp_dist.engine.round_record import evaluation_record, round_record

    class Agg:
        last_seconds, nbytes = 0.5, 800

    times = {"seconds": 2.0, "train_seconds": 1.0, "train_cpu_seconds": 0.75, "eval_seconds": 0.25}
    train = TrainSums(loss_sum=6.0, samples=4.0, nonfinite_clients=1.0)
    ev = EvalSums(correct=3.0, test_samples=4.0, acc_client_sum=1.5, clients=2.0, auc_weighted_sum=2.0, loss_sum=1.0)
    rec = round_record(2, times, Agg, [4, 1, 7], train, {"uplink_bytes_saved": 12}, ev, with_cohort=True)
    assert rec == {"kind": "round", "round": 3, **times, "allreduce_seconds": 0.5, "allreduce_bytes": 800,
                   "participants": 3, "train_loss": 1.5, "nonfinite_skipped": 1, "uplink_bytes_saved": 12,
                   "cohort": [4, 1, 7], "evaluated_after": 2, "acc": 0.75, "acc_client_mean": 0.75, "auc": 0.5,
                   "test_loss": 0.25}
    assert list(rec)[:8] == ["kind", "round", "seconds", "train_seconds", "train_cpu_seconds", "eval_seconds",
                             "allreduce_seconds", "allreduce_bytes"]  # metrics.jsonl's order
    # no evaluation, no cohort list, a peer exchange: its time after the all-reduce's
    rec = round_record(0, {**times, "peer_exchange_seconds": 0.125}, Agg, [0], TrainSums(), {}, None, False)
    # no sample trained on (an empty cohort): no loss, not a loss of 0
    assert "acc" not in rec and "cohort" not in rec and rec["train_loss"] is None
    assert list(rec)[7:9] == ["allreduce_bytes", "peer_exchange_seconds"]
    from fedcp_dist.rundir.present import progress_line
    from fedcp_dist.rundir.loggers import record_scalars

    e = {"evaluated_after": 0, "acc": 0.5, "acc_client_mean": 0.5, "auc": 0.5, "test_loss": 1.0}
    assert progress_line(6, e, rec) == ("[round 1/6] before training: acc 0.5000  client-mean 0.5000  auc 0.5000 | "
                                        "round 2.00 s (training 1.00 s), train loss n/a (no client trained)")
    assert progress_line(12, e, {**rec, "train_loss": 1.5, "dp_epsilon": 3.4567}) == (
        "[round  1/12] before training: acc 0.5000  client-mean 0.5000  auc 0.5000 | round 2.00 s "
        "(training 1.00 s), train loss 1.5000, ε 3.46")
    assert progress_line(6, {**e, "evaluated_after": 6}, None) == \
        "[final] after round 6: acc 0.5000  client-mean 0.5000  auc 0.5000"
    assert not any("train_loss" in str(s) for s in record_scalars(rec))  # nothing plotted for it
    assert evaluation_record(5, ev) == {"evaluated_after": 5, "acc": 0.75, "acc_client_mean": 0.75, "auc": 0.5,
                                          "test_loss": 0.25}


def test_client_order_sums_are_the_one_rank_sum_on_any_split():
    """Per-client fractions summed over ranks: rank by rank, 1 + (1e-16 + 1e-16) rounds up where
    client by client (1 + 1e-16) + 1e-16 stays 1; through ClientOrder's rows every split of the
    clients over ranks gives the one-rank sum, bit for bit."""
    from fedcp_dist.comm.aggregate import ClientOrder, TrainSums

    losses = [1.0, 1e-16, 1e-16]
    one_rank = 0.0
    for v in losses:
        one_rank += v
    by_rank = 1.0 + (1e-16 + 1e-16)
    assert by_rank != one_rank  # the order matters here
    for split in ([[0, 1, 2]], [[0], [1, 2]], [[1], [0, 2]], [[2], [1], [0]]):
        rows = torch.zeros(ClientOrder.size(TrainSums, 3), dtype=torch.float64)
        for part in split:  # each rank fills its clients' slots; the all-reduce adds the ranks' rows
            order = ClientOrder(TrainSums, 3)
            for c in part:
                order.add(c, TrainSums(loss_sum=losses[c], samples=1))
            rows += order.values
        got = TrainSums(loss_sum=123.0, samples=3)
        ClientOrder(TrainSums, 3).apply(rows, got)
        assert got.loss_sum == one_rank and got.samples == 3, split
