"""FedCP's practitioner switches on small hand-computed numbers: policy caching
(policy_refresh_every), federated policy distillation with skipped CPN uploads (cpn_distill,
cpn_upload_every), the hierarchical policy (cpn_groups) and the asynchronous CPN
(cpn_async_min_rate) with the per-group weights of the one all-reduce; fused training equals
sequential training with them on; one 1-vs-2-rank run of each, two of which also resume
bit-exactly."""
import math

import pytest
import torch

from helpers import (algo_with_moved_global, assert_states_close, load_run, one_vs_two_ranks, random_client,
                     resume_before_last_checkpoint, tiny_data, tiny_fedcp)
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import (PREV, FedCP, combine_group_logits, group_pool, interpolate, policy,
                                         policy_kl, refresh_alpha)
from fedcp_dist.config import load_config
from fedcp_dist.errors import UserError
from fedcp_dist.fused_groups import train_group

CPU = torch.device("cpu")


def _ctx(t, probe=False):
    return Context(t, 0, torch.Generator().manual_seed(3), probe)


def _policy_keys(gs):
    return [k for k in gs if k.startswith(("cpn.", "vproj."))]


# ---------------------------------------------------------------- 6. policy caching


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


@pytest.mark.parametrize("override, key", [
    ("policy_refresh_every=0", "policy_refresh_every"),
    ("policy_refresh_every=2 cpn_warmup_rounds=1", "policy_refresh_every"),
    ("policy_refresh_every=2 fedcp_cpn=false", "policy_refresh_every"),
    ("policy_refresh_every=2 compress=topk compress_ratio=0.5", "policy_refresh_every"),
])
def test_bad_values_name_their_key(tmp_path, override, key):
    shard = tmp_path / "x.h5"
    shard.write_bytes(b"")
    with pytest.raises(UserError, match=f"'{key}'"):
        load_config("configs/digits_fedcp.yaml", [f"data.path={shard}", "rounds=30", *override.split()])


# ---------------------------------------------------------------- 9. policy distillation, skipped uploads


def test_policy_kl_by_hand():
    # K = 1: teacher (0.5, 0.5), student (0.75, 0.25): 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 ln(4/3)
    teacher, student = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
    assert policy_kl(teacher, student, 1, 1.0).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-7)
    # τ = 2 halves the logits: student (√3/(√3+1), 1/(√3+1))
    q = math.sqrt(3) / (math.sqrt(3) + 1)
    want = 0.5 * math.log(0.5 / q) + 0.5 * math.log(0.5 / (1 - q))
    assert policy_kl(teacher, student, 1, 2.0).item() == pytest.approx(want, abs=1e-7)
    # K = 2, two samples, per sample the sum over features; equal policies: 0
    t2 = torch.tensor([[0.0, 1.0, 0.0, 1.0], [2.0, 0.0, 2.0, 0.0]])
    got = policy_kl(t2, t2.clone(), 2, 1.0)
    assert got.shape == (2,) and torch.allclose(got, torch.zeros(2), atol=1e-7)


def test_distillation_term_in_the_loss():
    from fedcp_dist.local_train import Step

    kappa = 0.7
    algo, gs = tiny_fedcp(cpn_distill=kappa, cpn_train_gumbel=False)
    plain, _ = tiny_fedcp(cpn_train_gumbel=False)
    d = tiny_data(n=8)
    x, y = d.train_batch()
    values = {"v": algo.init_client_state(0)["v"]}
    modules = algo.train_phase.modules
    # the working CPN differs from the received one (the teacher): the moved global state
    loss = algo.loss(Step(x, y, modules, values, torch.Generator().manual_seed(1)))
    base = plain.loss(Step(x, y, plain.train_phase.modules, values, torch.Generator().manual_seed(1)))
    with torch.no_grad():
        h = algo.fe(x)
        c = torch.nn.functional.normalize(values["v"], dim=-1) * h
        zt, zs = algo.cpn_g.net(c).view(-1, 2, 3), algo.cpn.net(c).view(-1, 2, 3)
        pt, ps = torch.softmax(zt, -2), torch.softmax(zs, -2)
        kl = (pt * (pt / ps).log()).sum((-2, -1)).mean()
    assert kl > 1e-4
    assert loss.item() == pytest.approx(base.item() + kappa * kl.item(), abs=1e-6)
    # the teacher equal to the own CPN: no term
    algo.set_global({**gs, **{"cpn." + n: p.detach().clone() for n, p in algo.cpn.named_parameters()}})
    plain.set_global(algo.gs)
    a = algo.loss(Step(x, y, modules, values, torch.Generator().manual_seed(1)))
    b = plain.loss(Step(x, y, plain.train_phase.modules, values, torch.Generator().manual_seed(1)))
    assert a.item() == pytest.approx(b.item(), abs=1e-7)


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


@pytest.mark.parametrize("override, key", [
    ("cpn_distill=-1", "cpn_distill"), ("cpn_upload_every=0", "cpn_upload_every"),
    ("cpn_upload_every=2 policy_refresh_every=2", "cpn_upload_every"),
    ("cpn_distill=0.1 policy_refresh_every=2", "cpn_distill"),
    ("cpn_upload_every=2 compress=topk compress_ratio=0.5", "cpn_upload_every"),
    ("cpn_distill=0.1 fedcp_cpn=false", "cpn_distill"),
])
def test_bad_distillation_values_name_their_key(tmp_path, override, key):
    test_bad_values_name_their_key(tmp_path, override, key)


# ---------------------------------------------------------------- 7. hierarchical policy


def test_group_combination_by_hand():
    # K = 2, G = 1. Feature-level pairs: feature 0 (ln 3, 0) → s = 3/4; feature 1 (0, 0) → s = 1/2.
    # Group pair (ln 2, 0) → s^group = 2/3. s_k = s·s^g / (s·s^g + r·r^g):
    # feature 0: (3/4·2/3) / (3/4·2/3 + 1/4·1/3) = 6/7; feature 1: (1/2·2/3) / (1/2·2/3 + 1/2·1/3) = 2/3
    logits = torch.tensor([[math.log(3.0), 0.0, 0.0, 0.0]])  # (B, 2K): the s-logits of both features, then r's
    group = torch.tensor([[math.log(2.0), 0.0]])
    s, r, _ = policy(combine_group_logits(logits, group, 2), 2, 1.0)
    assert torch.allclose(s, torch.tensor([[6 / 7, 2 / 3]]), atol=1e-6)
    assert torch.allclose(r, torch.tensor([[1 / 7, 1 / 3]]), atol=1e-6)
    # K = 4, G = 2: features 0, 1 in group 0 and 2, 3 in group 1 (contiguous blocks)
    z = torch.zeros(1, 8)
    zg = torch.tensor([[math.log(3.0), 0.0, 0.0, math.log(3.0)]])  # group 0: s 3/4; group 1: s 1/4
    s, r, _ = policy(combine_group_logits(z, zg, 4), 4, 1.0)
    assert torch.allclose(s, torch.tensor([[0.75, 0.75, 0.25, 0.25]]), atol=1e-6)
    # the pooled input: the mean of each block
    c = torch.tensor([[1.0, 3.0, -2.0, 6.0]])
    assert torch.equal(group_pool(c, 2), torch.tensor([[2.0, 2.0]]))


class Small4(torch.nn.Module):
    """features: 2x2 image → Linear(4, 4) → Tanh; head: Linear(4, 3) (K = 4)."""

    def __init__(self):
        super().__init__()
        self.feature_dim = 4
        self.features = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.head = torch.nn.Linear(4, 3)


def _fedcp4(**kw):
    return tiny_fedcp(net=Small4, **kw)


@pytest.mark.parametrize("hard", [False, True])
def test_group_policy_keeps_s_plus_r_one_and_trains(hard):
    algo, gs = _fedcp4(cpn_groups=2, cpn_hard=hard, cpn_eval_gumbel=True)
    assert sorted(k for k in gs if k.startswith("cpng.")) == ["cpng.0.bias", "cpng.0.weight", "cpng.1.bias",
                                                              "cpng.1.weight"]
    d = tiny_data(n=16)
    state = algo.init_client_state(0)
    x = d.train_batch()[0]
    logits, s = algo.predict_probe(state, x, _ctx(1))
    out = algo._eval_heads(state, x, _ctx(1))
    r = out.policy_logits  # the combined pair logits; s + r = 1 per feature of every sample
    assert s.shape == (16, 4)
    s2, r2, _ = policy(r, 4, algo.cfg.tau)
    assert torch.allclose(s2 + r2, torch.ones(16, 4), atol=1e-6)
    assert ((s > 0) & (s < 1)).all() or hard
    if hard:
        assert set(s.unique().tolist()) <= {0.0, 1.0}
    # the group network's values are the ones combined: its s-logit shift moves every feature of a group
    with torch.no_grad():
        h = algo.fe_g(x)
        c = torch.nn.functional.normalize(state["v"], dim=-1) * h
        want = combine_group_logits(algo.cpn_g.net(c), algo.cpng_g(group_pool(c, 2)), 4)
    assert torch.allclose(out.policy_logits, want, atol=1e-6)
    res = algo.local_train(state, d, _ctx(0))
    for k in gs:
        if k.startswith("cpng.") and k.endswith("weight"):
            assert not torch.equal(res.upload[k], gs[k]), k


def test_groups_must_divide_k_and_default_draws_nothing_more():
    with pytest.raises(UserError, match="'cpn_groups'"):
        _fedcp4(cpn_groups=3)
    a, ga = _fedcp4()
    b, gb = _fedcp4(cpn_groups=4)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)  # the group CPN is drawn after everything else
    # Linear(4, 8): 4·8 + 8, LayerNorm(8): 2·8; FLOPs 2·4·8
    assert "group policy (G=4): 56 parameters, 64 FLOPs/sample" in b.describe()


# ---------------------------------------------------------------- 8. asynchronous CPN


class _OneRank:
    def all_reduce_sum_(self, t):
        return t


def test_group_weights_in_the_one_buffer_by_hand():
    from fedcp_dist.aggregate import FlatAggregator

    spec = {"w": torch.Size([2]), "p": torch.Size([1])}
    plain = FlatAggregator(spec, 1, CPU)
    agg = FlatAggregator(spec, 1, CPU, groups={"p": "policy"})
    assert plain.buffer.numel() == 3 + 1 + 1 and agg.buffer.numel() == 3 + 3 + 1  # Σn, Σn(policy), count(policy)
    agg.add({"w": torch.tensor([1.0, 2.0]), "p": torch.tensor([10.0])}, 2)
    agg.add({"w": torch.tensor([4.0, 8.0])}, 3, skip=("policy",))  # froze its CPN: sends none
    agg.add_metrics([7.0])
    mean, total, metrics = agg.reduce(_OneRank())
    # w over both: (2·[1, 2] + 3·[4, 8]) / 5 = [2.8, 5.6]; p over the one that sent it: 2·10 / 2 = 10
    # (diluted over both it would be 4)
    assert torch.allclose(mean["w"], torch.tensor([2.8, 5.6])) and torch.equal(mean["p"], torch.tensor([10.0]))
    assert total == 5 and metrics == [7.0] and agg.group_totals == {"policy": (2.0, 1.0)}
    assert agg.group_numel("policy") == 1
    agg.begin_round()
    agg.add({"w": torch.tensor([4.0, 8.0])}, 3, skip=("policy",))
    mean, total, _ = agg.reduce(_OneRank())
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
        assert algo.async_frozen({**state, "participations": torch.tensor([float(count)])}, t) == frozen, (t, count)
    d = tiny_data(n=16)
    for count, frozen in ((1, True), (2, False)):
        st = {**state, "participations": torch.tensor([float(count)])}
        res = algo.local_train(st, d, _ctx(4, probe=True))
        assert res.skipped == (("policy",) if frozen else ())
        assert all((k in res.upload) != frozen for k in keys)
        assert all(torch.equal(res.extra["trained"][k], gs[k]) == frozen for k in keys if k.endswith("weight"))
        assert torch.equal(res.client_state["participations"], torch.tensor([count + 1.0]))
        assert not torch.equal(res.upload["features.1.weight"], gs["features.1.weight"])


@pytest.mark.parametrize("override, key", [
    ("cpn_async_min_rate=1.5", "cpn_async_min_rate"), ("cpn_async_min_rate=0.5 policy_refresh_every=2", "cpn_async_min_rate"),
    ("cpn_async_min_rate=0.5 cpn_upload_every=2", "cpn_async_min_rate"),
    ("cpn_async_min_rate=0.5 compress=topk compress_ratio=0.5", "cpn_async_min_rate"),
    ("cpn_async_min_rate=0.5 fedcp_cpn=false", "cpn_async_min_rate"),
])
def test_bad_async_values_name_their_key(tmp_path, override, key):
    test_bad_values_name_their_key(tmp_path, override, key)


# ---------------------------------------------------------------- fused, ranks, resume


@pytest.mark.parametrize("switches", [dict(policy_refresh_every=3, cpn_groups=8, tau=0.5),
                                      dict(cpn_distill=0.5, cpn_upload_every=2, cpn_groups=8),
                                      dict(cpn_distill=0.5, cpn_upload_every=2),
                                      dict(cpn_groups=8, cpn_hard=True)])
def test_switches_train_fused_as_sequentially(float64, switches):
    algo, gs = algo_with_moved_global(FedCP, shape=(1, 16, 16), lam=1.0, lr=0.01, drop_last=False, rounds=6,
                                      **switches)
    assert algo.fused_reason() is None
    datas = [random_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate((23, 7, 31))]
    for t in (0, 1):  # a refresh (upload) round and one between
        items = [({**algo.init_client_state(d.cid), "v": algo.init_client_state(d.cid)["v"] + 0.1 * d.cid}, d,
                  Context(t, d.cid, torch.Generator().manual_seed(11 + d.cid))) for d in datas]
        fus = train_group(algo, items)
        seq = [algo.local_train(s, d, Context(t, c.client, torch.Generator().manual_seed(11 + c.client)))
               for s, d, c in items]
        for a, b in zip(seq, fus):
            assert a.samples == b.samples and b.loss_sum == pytest.approx(a.loss_sum, rel=1e-9)
            assert set(a.upload) == set(b.upload)
            for k in a.upload:
                assert torch.allclose(a.upload[k], b.upload[k], atol=1e-10, rtol=0), (t, k)
            moved = {k for k in a.upload if not torch.equal(a.upload[k], gs[k])}
            assert any(k.startswith("features.") for k in moved)
            assert any(k.startswith("cpn.") for k in moved) == algo.policy_uploaded(t)
            assert any(k.startswith("cpng.") for k in moved) == (algo.policy_uploaded(t) and algo.cpng is not None)


ROUNDS = 4
SWITCHES = ["policy_refresh_every=2", "cpn_groups=8"]
DISTILL = ["cpn_distill=0.5", "cpn_upload_every=2", "cpn_groups=8"]
ASYNC = ["cpn_async_min_rate=0.6", "participation=0.5", "cpn_groups=8"]


def _overrides(shard, switches):
    return lambda out: [f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=2", "keep_checkpoints=2",
                        f"data.path={shard}", f"out_dir={out}", "threads=1", "fused=false", *switches]


@pytest.mark.slow
def test_switches_one_vs_two_ranks_and_exact_resume(digits6, tmp_path):
    """Three short runs, caching with groups, distillation with skipped uploads and groups, and the
    asynchronous CPN with groups at participation 0.5, each on one and two ranks: the same trajectory; the skipped
    bytes counted per round, the rounds nobody sends the CPN in with an all-reduce shorter by it;
    caching (Θ_prev in the global state) and the asynchronous CPN (the participation counts in the
    client states) resume bit-exactly from their round-2 checkpoints."""
    config = "configs/digits_fedcp.yaml"
    for name, switches in (("cache", SWITCHES), ("distill", DISTILL), ("async", ASYNC)):
        one, two, lines = tmp_path / f"{name}1", tmp_path / f"{name}2", []
        summary = one_vs_two_ranks(config, _overrides(digits6, switches), one, two, echo=lines.append)
        assert any("group policy (G=8): 176 parameters, 256 FLOPs/sample" in l for l in lines), lines[:1]
        (s1, acc1, rec1), (s2, acc2, rec2) = load_run(one), load_run(two)
        assert any(k.startswith("cpng.") for k in s1)
        assert any(k.startswith("prev.cpn.") for k in s1) == (name == "cache")
        assert_states_close(s1, s2, label=name)
        assert len(acc1) == ROUNDS + 1 and acc1 == pytest.approx(acc2, abs=1e-9)
        # rounds 1 and 3 (0-based) skip the CPN (K = 512: Linear(512, 1024) and LayerNorm(1024)) and the
        # group CPN: 527360 + 176 parameters per uploader, 4 bytes each
        skipped = 527360 + 176  # the CPN as the start line counts it; Linear(8, 16): 8·16 + 16, LayerNorm(16): 2·16
        for t, rec in enumerate(rec1):
            if name == "async":  # whole CPNs of the clients whose rate fell below q (none in round 0)
                assert rec["uplink_bytes_saved"] % (4 * skipped) == 0 and (t > 0 or rec["uplink_bytes_saved"] == 0)
            else:
                assert rec["uplink_bytes_saved"] == (4 * rec["participants"] * skipped if t % 2 else 0), (name, t)
                # nobody sends the CPN: it leaves the round's (float64) all-reduce
                assert rec["allreduce_bytes"] == rec1[0]["allreduce_bytes"] - (8 * skipped if t % 2 else 0), (name, t)
            assert rec == {**rec, **{k: rec2[t][k] for k in ("uplink_bytes_saved", "uplink_bytes_sent")}}
        assert summary["uplink_bytes_saved"] == sum(r["uplink_bytes_saved"] for r in rec1) > 0
        total = summary["uplink_bytes_sent"] + summary["uplink_bytes_saved"]
        assert summary["uplink_saved_fraction"] == pytest.approx(summary["uplink_bytes_saved"] / total)
        if name != "distill":
            s3, acc3, _ = resume_before_last_checkpoint(config, _overrides(digits6, switches), one,
                                                        tmp_path / f"{name}-resumed", ROUNDS)
            assert all(torch.equal(s1[k], s3[k]) for k in s1) and acc3[-ROUNDS - 1:] == acc1
