"""FedCP's switches in whole runs: bad values name their key, fused training equals sequential
training with the switches on, one rank equals two, and runs resume bit-exactly."""
import pytest
import torch

from helpers import (algo_with_moved_global, assert_states_close, load_run, random_client, resume_before_last_checkpoint,
                     runs_on_one_and_two_ranks)
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import FedCP
from fedcp_dist.config import Config, load_config
from fedcp_dist.errors import UserError
from fedcp_dist.fused.groups import train_group

CPU = torch.device("cpu")


@pytest.mark.parametrize("override, key", [
    ("mmd_kernel=gauss", "mmd_kernel"), ("mmd_sigma=-1", "mmd_sigma"), ("mmd_sigma=mean", "mmd_sigma"),
    ("mmd_bandwidths=[1,-2]", "mmd_bandwidths"), ("mmd_bandwidths=[]", "mmd_bandwidths"),
    ("mmd_kernel=multi mmd_sigma=2", "mmd_sigma"), ("mmd_kernel=rbf mmd_bandwidths=[1]", "mmd_bandwidths"),
    ("cpn_warmup_rounds=-1", "cpn_warmup_rounds"), ("cpn_warmup_rounds=30", "cpn_warmup_rounds"),
    ("cpn_lr=0", "cpn_lr"), ("cpn_lr_schedule=step", "cpn_lr_schedule"), ("cpn_lr_min=0.001", "cpn_lr_min"),
    ("cpn_lr_schedule=cosine cpn_lr_min=1", "cpn_lr_min"), ("tau_final=0", "tau_final"),
    ("tau_anneal=linear", "tau_anneal"), ("tau_anneal=cubic tau_final=0.1", "tau_anneal"),
    ("cpn_hidden=-4", "cpn_hidden"), ("cpn_hidden=8 cpn_layers=2", "cpn_hidden"),
    ("fedcp_cpn=false cpn_hard=true", "cpn_hard"), ("policy_entropy=x", "policy_entropy"),
])
def test_bad_values_name_their_key(tmp_path, override, key):
    shard = tmp_path / "x.h5"
    shard.write_bytes(b"")
    with pytest.raises(UserError, match=f"'{key}'"):
        load_config("configs/digits_fedcp.yaml", [f"data.path={shard}", "rounds=30", *override.split()])


ALL = dict(mmd_kernel="rbf", mmd_sigma="median", policy_entropy=0.05, cpn_warmup_rounds=1, cpn_lr=0.02,
           cpn_lr_schedule="cosine", cpn_lr_min=0.005, tau=0.5, tau_final=0.2, tau_anneal="linear", cpn_hard=False,
           cpn_hidden=16, rounds=5)


@pytest.mark.parametrize("hard", [False, True])
def test_all_switches_train_fused_as_sequentially(float64, hard):
    algo, gs = algo_with_moved_global(FedCP, shape=(1, 16, 16), lam=1.0, lr=0.01, drop_last=False,
                                      **{**ALL, "cpn_hard": hard})
    assert algo.fused_reason() is None
    datas = [random_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate((23, 7, 31))]
    for t in (0, 3):  # a warm-up round and a round with the CPN's own cosine rate
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
            assert any(k.startswith("cpn.") for k in moved) == (t >= 1)  # the warm-up sends no CPN


ROUNDS = 4


SWITCHES = ["mmd_kernel=rbf", "mmd_sigma=median", "policy_entropy=0.01", "cpn_warmup_rounds=1", "cpn_lr=0.1",
            "cpn_lr_schedule=cosine", "cpn_lr_min=0.01", "tau=0.5", "tau_final=0.3", "tau_anneal=linear",
            "cpn_hard=true", "cpn_hidden=32"]


#: caching with groups; distillation with skipped uploads and groups; the asynchronous CPN with groups
SWITCHES2 = ["policy_refresh_every=2", "cpn_groups=8"]
DISTILL = ["cpn_distill=0.5", "cpn_upload_every=2", "cpn_groups=8"]
ASYNC = ["cpn_async_min_rate=0.6", "participation=0.5", "cpn_groups=8"]


def _overrides(shard, switches):
    return lambda out: [f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=2", "keep_checkpoints=2",
                        f"data.path={shard}", f"out_dir={out}", "threads=1", "fused=false", *switches]


CONFIG = "configs/digits_fedcp.yaml"


@pytest.fixture(scope="module")
def switch_runs(digits6_16px, tmp_path_factory):
    """The four short runs of the tests below on one rank and on two (root/one/NAME, root/two/NAME),
    and the one-rank world's output."""
    root = tmp_path_factory.mktemp("switch-runs")
    jobs = {name: (CONFIG, _overrides(digits6_16px, switches))
            for name, switches in (("all", SWITCHES), ("cache", SWITCHES2), ("distill", DISTILL), ("async", ASYNC))}
    outs = runs_on_one_and_two_ranks(root, jobs)
    return root, outs["one"].splitlines()


@pytest.mark.slow
def test_all_switches_one_vs_two_ranks_and_exact_resume(switch_runs, digits6_16px, tmp_path):
    """One short run with every switch on (τ = 0.5, hard policy): one rank and two ranks give the
    same trajectory; it learns; the warm-up round sends no CPN (its bytes saved, the all-reduce
    shorter by it); a resume from the round-2 checkpoint ends bit-identically."""
    (root, lines), overrides = switch_runs, _overrides(digits6_16px, SWITCHES)
    cpn = 52256  # the light CPN as the start line counts it: Linear(512, 32), Linear(32, 1024), LayerNorm(1024)
    assert any(f"CPN (light, H=32, K=512): {cpn} parameters, 98304 FLOPs/sample" in l for l in lines), lines[:1]
    (s1, acc1, rec1), (s2, acc2, rec2) = load_run(root / "one" / "all"), load_run(root / "two" / "all")
    assert any(k.startswith("cpn.net.2.") for k in s1)
    assert_states_close(s1, s2)
    assert len(acc1) == ROUNDS + 1 and acc1 == pytest.approx(acc2, abs=1e-9)
    assert acc1[-1] > acc1[0] + 0.2  # τ = 0.5 with the hard policy learns
    # round 1 (W = 1) leaves the CPN out: 4 bytes a parameter per uploader saved, 8 (float64) out of the all-reduce
    n = rec1[0]["participants"]
    assert [r["uplink_bytes_saved"] for r in rec1] == [4 * n * cpn] + [0] * (ROUNDS - 1)
    assert rec1[0]["uplink_bytes_sent"] == rec1[1]["uplink_bytes_sent"] - 4 * n * cpn
    assert rec1[0]["allreduce_bytes"] == rec1[1]["allreduce_bytes"] - 8 * cpn
    assert [r["uplink_bytes_saved"] for r in rec2] == [r["uplink_bytes_saved"] for r in rec1]
    s3, acc3, _ = resume_before_last_checkpoint(CONFIG, overrides, root / "one" / "all", tmp_path / "resumed", ROUNDS)
    assert all(torch.equal(s1[k], s3[k]) for k in s1) and acc3[-ROUNDS - 1:] == acc1


@pytest.mark.parametrize("switch, refused", [
    ({}, False), ({"tau_final": 0.1}, True), ({"cpn_lr_schedule": "cosine"}, True), ({"cpn_warmup_rounds": 2}, False)])
def test_resume_refuses_a_new_round_count_under_a_round_schedule(tmp_path, switch, refused):
    from fedcp_dist.rundir.directory import check_resume_config

    old = {**Config().to_dict(), "rounds": 10, **switch}
    new = {**old, "rounds": 20}
    if refused:
        with pytest.raises(UserError, match="'rounds'.*anneal over the total number of rounds"):
            check_resume_config(old, new, tmp_path)
    else:
        check_resume_config(old, new, tmp_path)


@pytest.mark.parametrize("override, key", [
    ("policy_refresh_every=0", "policy_refresh_every"),
    ("policy_refresh_every=2 cpn_warmup_rounds=1", "policy_refresh_every"),
    ("policy_refresh_every=2 fedcp_cpn=false", "policy_refresh_every"),
    ("policy_refresh_every=2 compress=topk compress_ratio=0.5", "policy_refresh_every"),
])
def test_bad_caching_values_name_their_key(tmp_path, override, key):
    shard = tmp_path / "x.h5"
    shard.write_bytes(b"")
    with pytest.raises(UserError, match=f"'{key}'"):
        load_config("configs/digits_fedcp.yaml", [f"data.path={shard}", "rounds=30", *override.split()])


@pytest.mark.parametrize("override, key", [
    ("cpn_distill=-1", "cpn_distill"), ("cpn_upload_every=0", "cpn_upload_every"),
    ("cpn_upload_every=2 policy_refresh_every=2", "cpn_upload_every"),
    ("cpn_distill=0.1 policy_refresh_every=2", "cpn_distill"),
    ("cpn_upload_every=2 compress=topk compress_ratio=0.5", "cpn_upload_every"),
    ("cpn_distill=0.1 fedcp_cpn=false", "cpn_distill"),
])
def test_bad_distillation_values_name_their_key(tmp_path, override, key):
    test_bad_values_name_their_key(tmp_path, override, key)


@pytest.mark.parametrize("override, key", [
    ("cpn_async_min_rate=1.5", "cpn_async_min_rate"), ("cpn_async_min_rate=0.5 policy_refresh_every=2", "cpn_async_min_rate"),
    ("cpn_async_min_rate=0.5 cpn_upload_every=2", "cpn_async_min_rate"),
    ("cpn_async_min_rate=0.5 compress=topk compress_ratio=0.5", "cpn_async_min_rate"),
    ("cpn_async_min_rate=0.5 fedcp_cpn=false", "cpn_async_min_rate"),
])
def test_bad_async_values_name_their_key(tmp_path, override, key):
    test_bad_values_name_their_key(tmp_path, override, key)


@pytest.mark.parametrize("switches", [dict(policy_refresh_every=3, cpn_groups=8, tau=0.5),
                                      dict(cpn_distill=0.5, cpn_upload_every=2, cpn_groups=8),
                                      dict(cpn_distill=0.5, cpn_upload_every=2),
                                      dict(cpn_groups=8, cpn_hard=True)])
def test_caching_groups_and_async_train_fused_as_sequentially(float64, switches):
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
            assert any(k.startswith("cpn.") for k in moved) == algo.sync.uploaded(t)
            assert any(k.startswith("cpng.") for k in moved) == (algo.sync.uploaded(t) and "cpng" in algo.own)




@pytest.mark.slow
def test_caching_groups_and_async_one_vs_two_ranks_and_exact_resume(switch_runs, digits6_16px, tmp_path):
    """Three short runs, caching with groups, distillation with skipped uploads and groups, and the
    asynchronous CPN with groups at participation 0.5, each on one and two ranks: the same trajectory; the skipped
    bytes counted per round, the rounds nobody sends the CPN in with an all-reduce shorter by it;
    caching (Θ_prev in the global state) and the asynchronous CPN (the participation counts in the
    client states) resume bit-exactly from their round-2 checkpoints."""
    import json

    (root, lines) = switch_runs
    assert any("group policy (G=8): 176 parameters, 256 FLOPs/sample" in l for l in lines), lines[:1]
    for name, switches in (("cache", SWITCHES2), ("distill", DISTILL), ("async", ASYNC)):
        one, two = root / "one" / name, root / "two" / name
        summary = json.loads((one / "summary.json").read_text())
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
            s3, acc3, _ = resume_before_last_checkpoint(CONFIG, _overrides(digits6_16px, switches), one,
                                                        tmp_path / f"{name}-resumed", ROUNDS)
            assert all(torch.equal(s1[k], s3[k]) for k in s1) and acc3[-ROUNDS - 1:] == acc1
