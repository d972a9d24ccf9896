"""How FedCP's policy networks are synchronised, on small hand-computed numbers: the warm-up, policy
caching (refresh and interpolation), uploads every U-th round, the asynchronous CPN, and the
per-group weights of the one all-reduce."""
import pytest
import torch

from helpers import FakeRuntime, tiny_data, tiny_fedcp
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import PREV, interpolate, refresh_alpha

CPU = torch.device("cpu")


def _ctx(t, probe=False):
    return Context(t, 0, torch.Generator().manual_seed(3), probe)


def _policy_keys(gs):
    return [k for k in gs if k.startswith(("cpn.", "vproj."))]


@pytest.mark.parametrize("vector", ["head", "head+embed"])
def test_warmup_freezes_the_cpn_and_its_upload(vector):
    algo, gs = tiny_fedcp(cpn_warmup_rounds=2, cpn_client_vector=vector)
    assert any(k.startswith("vproj.") for k in gs) == (vector != "head")
    d = tiny_data(n=16)
    for t, frozen in ((0, True), (1, True), (2, False)):
        res = algo.local_train(algo.init_client_state(0), d, Context(t, 0, torch.Generator().manual_seed(3), True))
        assert algo.skipped_groups(t) == (("policy",) if frozen else ())  # nobody sends the CPN in a warm-up round
        for k in gs:
            if k.startswith(("cpn.", "vproj.")):
                assert torch.equal(res.extra["trained"][k], gs[k]) == frozen, (t, k)
                assert (k in res.upload) != frozen, (t, k)
        assert not torch.equal(res.upload["features.1.weight"], gs["features.1.weight"])
        assert not torch.equal(res.client_state["head.weight"], gs["head.weight"])


def test_warmup_round_keeps_the_cpn_out_of_the_all_reduce():
    """A warm-up round's all-reduce holds no CPN: the global CPN after it is the one before, bit for
    bit, and its bytes count as saved; the first round after the warm-up sends and averages it."""
    from fedcp_dist.comm.aggregate import FlatAggregator
    from fedcp_dist.comm.compress import Compressor, uplink_record

    algo, gs = tiny_fedcp(cpn_warmup_rounds=1)
    upload = algo.upload_keys(gs)
    agg = FlatAggregator({k: gs[k].shape for k in upload}, 1, CPU, groups=algo.aggregation_groups(upload))
    # parameters: extractor Linear(4, 3) 15, head Linear(3, 3) 12, CPN Linear(3, 6) 24 + LayerNorm(6) 12 = 36
    assert agg.num_params == 63 and agg.group_numel("policy") == 36 and agg.groups == ["policy"]
    off = Compressor("none", 1.0, 32, False, agg.shapes)
    datas = [tiny_data(n=16, seed=1), tiny_data(n=8, seed=2)]
    for t in (0, 1):
        algo.begin_round(t)
        agg.begin_round(algo.skipped_groups(t))
        # the buffer: the sent values, Σ n, Σ n and count of the policy group, one metric
        assert agg.buffer.numel() == (63 - 36 if t == 0 else 63) + 3 + 1
        for i, d in enumerate(datas):
            res = algo.local_train(algo.init_client_state(i), d, Context(t, i, torch.Generator().manual_seed(i)))
            agg.add(res.upload, d.n_train, skip=res.skipped)
        agg.add_metrics([0.0])
        mean, total, _ = agg.reduce(FakeRuntime())
        new = algo.server_update(gs, mean)
        cpn = [k for k in gs if k.startswith("cpn.")]
        assert total == 24 and all(torch.equal(new[k], gs[k]) == (t == 0) for k in cpn), t
        assert not torch.equal(new["features.1.weight"], gs["features.1.weight"])
        # two uploaders: 4 bytes per parameter sent, the CPN's 36 saved in the warm-up round
        sent = 4 * 2 * (27 if t == 0 else 63)
        assert uplink_record(off, agg, 2, 2) == {"uplink_bytes": sent, "uplink_bytes_dense": sent,
                                                 "downlink_bytes": 4 * 2 * 63, "downlink_bytes_dense": 4 * 2 * 63,
                                                 "uplink_bytes_sent": sent,
                                                 "uplink_bytes_saved": 4 * 2 * 36 if t == 0 else 0}


def test_refresh_schedule_and_interpolation_by_hand():
    # P = 3: rounds 0, 3, 6 refresh (α = 0 of the new pair); α = 1/3, 2/3 in between
    assert [refresh_alpha(t, 3) for t in range(7)] == [0, 1 / 3, 2 / 3, 0, 1 / 3, 2 / 3, 0]
    assert [refresh_alpha(t, 1) for t in range(3)] == [0, 0, 0]
    prev, last = torch.tensor([1.0, 2.0, -3.0]), torch.tensor([4.0, -1.0, 3.0])
    # Θ_prev + α(Θ_last − Θ_prev): α = 1/3 → [2, 1, −1]; α = 2/3 → [3, 0, 1]
    assert torch.allclose(interpolate(prev, last, 1 / 3), torch.tensor([2.0, 1.0, -1.0]))
    assert torch.allclose(interpolate(prev, last, 2 / 3), torch.tensor([3.0, 0.0, 1.0]))
    assert interpolate(prev, last, 0) is prev and interpolate(prev, last, 1) is last


@pytest.mark.parametrize("vector", ["head", "head+embed"])
def test_refresh_rounds_train_and_upload_the_cpn_and_between_them_interpolate(vector):
    algo, gs = tiny_fedcp(policy_refresh_every=3, cpn_client_vector=vector)
    keys = _policy_keys(gs)
    assert keys and all(PREV + k in gs for k in keys) and not any(k.startswith(PREV) for k in algo.upload_keys(gs))
    d = tiny_data(n=16)
    for t in range(4):
        res = algo.local_train(algo.init_client_state(0), d, _ctx(t, probe=True))
        trained = res.extra["trained"]
        if t % 3 == 0:  # refresh: trained from Θ_last and uploaded
            assert all(not torch.equal(res.upload[k], gs[k]) for k in keys if k.endswith("weight")), t
            assert algo.skipped_groups(t) == ()
        else:  # frozen at Θ_prev + (t mod 3)/3 (Θ_last − Θ_prev); not sent, out of the round's all-reduce
            a = (t % 3) / 3
            for k in keys:
                assert torch.equal(trained[k], gs[PREV + k] + a * (gs[k] - gs[PREV + k])), (t, k)
                assert k not in res.upload, (t, k)
            assert algo.skipped_groups(t) == ("policy",)
        assert not torch.equal(res.upload["features.1.weight"], gs["features.1.weight"])


def test_refresh_server_update_and_evaluated_policy():
    algo, gs = tiny_fedcp(policy_refresh_every=2)
    keys = _policy_keys(gs)
    avg = {k: v + 1.0 for k, v in gs.items() if not k.startswith(PREV)}
    algo.begin_round(0)  # a refresh: Θ_prev ← Θ_last, Θ_last ← the mean
    new = algo.server_update(gs, avg)
    for k in keys:
        assert torch.equal(new[PREV + k], gs[k]) and torch.equal(new[k], avg[k])
    assert torch.equal(new["features.1.weight"], avg["features.1.weight"])
    algo.begin_round(1)  # between refreshes: the policy is not in the mean (out of the all-reduce), both kept
    newer = algo.server_update(new, {k: v + 5.0 for k, v in avg.items() if k not in keys})
    for k in keys:
        assert torch.equal(newer[PREV + k], new[PREV + k]) and torch.equal(newer[k], new[k])
    assert torch.equal(newer["features.1.weight"], avg["features.1.weight"] + 5.0)
    # evaluation before round t uses round t's policy: round 1 → halfway between Θ_prev and Θ_last
    algo.set_global(new)
    d = tiny_data(n=4)
    algo.predict(algo.init_client_state(0), d.train_batch()[0], _ctx(1))
    half = {k: gs[k] + 0.5 * (avg[k] - gs[k]) for k in keys}
    for n, p in algo.cpn_g.named_parameters():
        assert torch.allclose(p, half["cpn." + n], atol=1e-7), n
    algo.predict(algo.init_client_state(0), d.train_batch()[0], _ctx(2))  # a refresh round: Θ_last
    for n, p in algo.cpn_g.named_parameters():
        assert torch.equal(p, avg["cpn." + n]), n


def test_upload_every_trains_the_cpn_every_round_and_sends_it_every_third():
    algo, gs = tiny_fedcp(cpn_distill=0.5, cpn_upload_every=3)
    keys = _policy_keys(gs)
    n_cpn = sum(gs[k].numel() for k in keys)
    assert n_cpn == 3 * 6 + 6 + 2 * 6  # Linear(3, 6) and LayerNorm(6)
    d = tiny_data(n=16)
    for t in range(4):
        res = algo.local_train(algo.init_client_state(0), d, _ctx(t, probe=True))
        moved = all(not torch.equal(res.extra["trained"][k], gs[k]) for k in keys if k.endswith("weight"))
        assert moved, t  # trained in every round
        sent = t % 3 == 0
        assert all((k in res.upload) == sent for k in keys), t
        assert all(not torch.equal(res.upload[k], gs[k]) for k in keys if k.endswith("weight") and sent), t
        assert algo.skipped_groups(t) == (() if sent else ("policy",))
    assert algo.aggregation_groups(list(gs)) == {k: "policy" for k in keys}  # n_cpn values saved per uploader
    avg = {k: v + 1.0 for k, v in gs.items()}
    algo.begin_round(3)
    assert all(torch.equal(algo.server_update(gs, avg)[k], avg[k]) for k in keys)
    plain, _ = tiny_fedcp(cpn_distill=0.5)
    assert plain.aggregation_groups(list(gs)) is None and plain.skipped_groups(1) == ()  # no byte counts in records


def test_group_weights_in_the_one_buffer_by_hand():
    from fedcp_dist.comm.aggregate import FlatAggregator

    spec = {"w": torch.Size([2]), "p": torch.Size([1])}
    plain = FlatAggregator(spec, 1, CPU)
    agg = FlatAggregator(spec, 1, CPU, groups={"p": "policy"})
    assert plain.buffer.numel() == 3 + 1 + 1 and agg.buffer.numel() == 3 + 3 + 1  # Σn, Σn(policy), count(policy)
    agg.add({"w": torch.tensor([1.0, 2.0]), "p": torch.tensor([10.0])}, 2)
    agg.add({"w": torch.tensor([4.0, 8.0])}, 3, skip=("policy",))  # froze its CPN: sends none
    agg.add_metrics([7.0])
    mean, total, metrics = agg.reduce(FakeRuntime())
    # w over both: (2·[1, 2] + 3·[4, 8]) / 5 = [2.8, 5.6]; p over the one that sent it: 2·10 / 2 = 10
    # (diluted over both it would be 4)
    assert torch.allclose(mean["w"], torch.tensor([2.8, 5.6])) and torch.equal(mean["p"], torch.tensor([10.0]))
    assert total == 5 and metrics == [7.0] and agg.group_totals == {"policy": (2.0, 1.0)}
    assert agg.group_numel("policy") == 1
    agg.begin_round()
    agg.add({"w": torch.tensor([4.0, 8.0])}, 3, skip=("policy",))
    mean, total, _ = agg.reduce(FakeRuntime())
    assert set(mean) == {"w"} and total == 3  # nobody sent p: the server keeps its value


def test_async_rate_freezes_and_skips_the_cpn():
    algo, gs = tiny_fedcp(cpn_async_min_rate=0.5)
    keys = _policy_keys(gs)
    assert algo.aggregation_groups(list(gs)) == {k: "policy" for k in keys}
    assert tiny_fedcp()[0].aggregation_groups(list(gs)) is None
    assert "cpn_async_min_rate" in algo.fused_reason()
    state = algo.init_client_state(0)
    assert torch.equal(state["participations"], torch.zeros(1))
    # rate so far = rounds trained before t / t; round 0: 1
    for t, count, frozen in ((0, 0, False), (4, 1, True), (4, 2, False), (3, 1, True), (2, 1, False)):
        assert algo.sync.async_frozen({**state, "participations": torch.tensor([float(count)])}, t) == frozen, (t, count)
    d = tiny_data(n=16)
    for count, frozen in ((1, True), (2, False)):
        st = {**state, "participations": torch.tensor([float(count)])}
        res = algo.local_train(st, d, _ctx(4, probe=True))
        assert res.skipped == (("policy",) if frozen else ())
        assert all((k in res.upload) != frozen for k in keys)
        assert all(torch.equal(res.extra["trained"][k], gs[k]) == frozen for k in keys if k.endswith("weight"))
        assert torch.equal(res.client_state["participations"], torch.tensor([count + 1.0]))
        assert not torch.equal(res.upload["features.1.weight"], gs["features.1.weight"])
