"""Central user-level DP (fedcp_dist.comm.privacy, fedcp_dist.comm.privacy_accounting) on hand-computed
numbers: the clip, uniform weights and the fixed denominator through the trainer and the all-reduce,
the noise's standard deviation over many draws, adaptive clipping's update and noise split, ε against
dp-accounting's own accountant built independently here, the calibration to a target ε, Poisson
cohorts, the clip after quantisation, and every bad value refused in one line."""
import math
from types import SimpleNamespace

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import RdpAccountant

from helpers import FakeRuntime, Recorder
from fedcp_dist.comm.aggregate import FlatAggregator, TrainSums, reduce_sums, sums_size
from fedcp_dist.algorithms.base import LocalResult
from fedcp_dist.state.client_store import ClientStore
from fedcp_dist.comm.compress import Compressor
from fedcp_dist.config import Config, load_config, unflatten
from fedcp_dist.errors import UserError
from fedcp_dist.state.placement import STREAM_DP_NOISE, sample_cohort
from fedcp_dist.comm.privacy import (CentralDP, PrivacySums, add_noise_, clip_factor, plan_run, split_noise, total_norm)
from fedcp_dist.comm.privacy_accounting import Accountant, Sampling, calibrate_noise, epsilon_after, round_event
from fedcp_dist.engine.probes import RoundProbes
from fedcp_dist.engine.training import CohortTrainer

CPU = torch.device("cpu")
NR = dp_accounting.NeighboringRelation


def dp_config(num_clients: int = 0, **kw) -> Config:
    cfg = Config(**{"dp": "central", **kw})
    cfg.data.num_clients = num_clients
    return cfg


# ---------------------------------------------------------------- the clip, the weights, the denominator

def test_one_norm_over_every_uploaded_tensor_and_the_clip_factor():
    # Δ = ([3, 0], [[0, 4]]): one vector of norm 5
    assert total_norm([torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0]])]) == 5.0
    assert clip_factor(5.0, 1.0) == 0.2 and clip_factor(5.0, 5.0) == 1.0 and clip_factor(0.0, 1.0) == 1.0


def _trainer(cfg, uploads: dict, n_train: dict, global_state, compressor=None):
    class Algo(Recorder):
        peer_dim = 0

        def local_train(self, state, data, ctx):
            return LocalResult(upload={"w": uploads[ctx.client].clone()}, client_state=None, loss_sum=1.0, samples=1)

    algo = Algo()
    store = ClientStore(algo, global_state)
    dp = CentralDP(cfg, plan_run(cfg, cfg.data.num_clients))
    agg = FlatAggregator({"w": torch.Size([2])}, sums_size(TrainSums, PrivacySums), CPU)
    compressor = compressor or Compressor("none", 1.0, 32, False, agg.shapes)
    data = {c: SimpleNamespace(n_train=n) for c, n in n_train.items()}
    trainer = CohortTrainer(cfg, FakeRuntime(), algo, store, data, np.zeros(len(n_train), dtype=np.int64), None, agg,
                            compressor, dp)
    return trainer, dp, agg, store


def test_clipped_uniform_mean_with_a_fixed_denominator_hand_computed():
    """Global w = (1, 1). Client 0 uploads (4, 5): Δ = (3, 4), ‖Δ‖ = 5 > C = 1, sent as (0.6, 0.8);
    client 1 uploads (1, 1.5): Δ = (0, 0.5), unclipped. Each weighs 1 whatever its samples (8 and 2),
    and the sum is divided by m̄ = 4 (a fixed cohort of ⌊0.5·8⌋ of 8 clients), though only 2 trained:
    w' = (1, 1) + (0.6, 1.3)/4 = (1.15, 1.325). Without noise the mean is exact."""
    cfg = dp_config(seed=3, dp_clip=1.0, dp_noise_multiplier=0.0, participation=0.5, num_clients=8)
    gs = {"w": torch.tensor([1.0, 1.0])}
    trainer, dp, agg, _ = _trainer(cfg, {0: torch.tensor([4.0, 5.0]), 1: torch.tensor([1.0, 1.5])}, {0: 8, 1: 2}, gs)
    dp.begin_round()
    agg.begin_round()
    train, _ = trainer.train(0, [0, 1], RoundProbes(0, 2, 0, False))
    assert dp.local.unclipped_minus_half == 0.0  # client 0 clipped (−½), client 1 not (+½)
    mean, _, (_, sums) = reduce_sums(agg, FakeRuntime(), train, dp.local, base=gs, privatize=dp.privatizer(0))
    assert mean["w"].tolist() == pytest.approx([1.15, 1.325], abs=1e-7)
    # the sample-weighted mean of the same clipped deltas would be (1, 1) + (8·(0.6, 0.8) + 2·(0, 0.5))/10
    assert mean["w"].tolist() != pytest.approx([1.48, 1.74], abs=1e-3)
    assert sums.unclipped_minus_half == 0.0
    rec = dp.end_round(0, sums)
    assert rec["dp_clip"] == 1.0 and rec["dp_epsilon"] == math.inf and "dp_unclipped_fraction" not in rec


def test_the_noise_on_the_sum_is_z_times_c_scaled_to_the_cohort_and_the_same_bits_on_every_rank():
    """σ = 2, C = 0.5, m̄ = 10 of 40 clients, a noise cohort of M = 40: std = 2·0.5·10/40 = 0.25 per
    value, measured over 200,000 draws; the draw is a function of (seed, round) alone."""
    cfg = dp_config(seed=5, dp_noise_multiplier=2.0, dp_clip=0.5, participation=0.25, dp_noise_cohort_size=40,
                    num_clients=40)
    dp = CentralDP(cfg, plan_run(cfg, 40))
    assert dp.noise_std() == pytest.approx(0.25)
    x = torch.zeros(200_000, dtype=torch.float64)
    assert dp.privatizer(3)(x) == 10.0
    assert float(x.std()) == pytest.approx(0.25, rel=0.01) and abs(float(x.mean())) < 0.25 * 4 / math.sqrt(2e5)
    again = add_noise_(torch.zeros(200_000, dtype=torch.float64), 0.25, 5, STREAM_DP_NOISE, 3)
    assert torch.equal(x, again)  # every rank draws the same noise
    other = add_noise_(torch.zeros(200_000, dtype=torch.float64), 0.25, 5, STREAM_DP_NOISE, 4)
    assert not torch.equal(x, other)
    assert dp.summary(1)["dp_noise_cohort_size"] == 40 and isinstance(dp.summary(1)["dp_noise_cohort_size"], int) and "not a guarantee for this run" in dp.guarantee()
    assert dp.end_round(0, PrivacySums())["dp_guarantee"] is False


def test_compressed_uploads_are_clipped_after_quantisation_and_keep_only_the_unsent_clipped_part():
    torch.manual_seed(0)
    shapes = {"a": torch.Size([50]), "b": torch.Size([7, 3])}
    gs = {k: torch.randn(s) for k, s in shapes.items()}
    up = {k: v + torch.randn(v.shape) * 3 for k, v in gs.items()}
    ef = Compressor("topk", 0.3, 8, True, shapes)
    dec, w, res, norm = ef.compress_clipped(up, gs, list(shapes), 1.0, None)
    assert norm == pytest.approx(total_norm([up[k] - gs[k] for k in shapes]))
    assert w * total_norm(dec.values()) <= 1.0 + 1e-12  # what is added to the sum stays within C
    clipped = {k: (up[k] - gs[k]) * (1.0 / norm) for k in shapes}
    for k in shapes:
        assert torch.allclose(res[k], clipped[k] - w * dec[k], atol=1e-6)
        assert int((dec[k] != 0).sum()) <= math.ceil(0.3 * shapes[k].numel())
    assert total_norm(res.values()) <= 2.0 + 1e-6
    # 8-bit codes between a tensor's min and max can round a kept value up: the norm then exceeds C
    # before the second clip (seen here: the weight below 1)
    small = {"a": torch.tensor([0.0, 0.3, 0.61, 0.62, 1.0])}
    d, w2, _, _ = Compressor("topk", 1.0, 8, False, {"a": torch.Size([5])}).compress_clipped(
        {"a": small["a"] * 0.999}, {"a": torch.zeros(5)}, ["a"], 1.2, None)
    assert total_norm(d.values()) * w2 <= 1.2 + 1e-12
    # ratio 1 at 32 bits is plain clipping, with nothing left over
    plain = Compressor("topk", 1.0, 32, True, shapes)
    dec, w, res, norm = plain.compress_clipped(up, gs, list(shapes), 1.0, None)
    assert w == pytest.approx(1.0) and all(torch.allclose(dec[k], clipped[k], atol=1e-6) for k in shapes)
    assert total_norm(res.values()) < 1e-6


def test_the_trainer_sends_compressed_clipped_deltas_weighted_by_their_clip():
    cfg = dp_config(dp_noise_multiplier=0.0, dp_clip=0.5, num_clients=1, compress="topk",
                    compress_bits=8, compress_error_feedback=True)
    gs = {"w": torch.tensor([0.0, 0.0])}
    agg_shapes = {"w": torch.Size([2])}
    trainer, dp, agg, store = _trainer(cfg, {0: torch.tensor([3.0, 4.0])}, {0: 5}, gs,
                                       Compressor("topk", 1.0, 8, True, agg_shapes))
    dp.begin_round()
    agg.begin_round()
    trainer.train(0, [0], RoundProbes(0, 1, 0, False))
    added = agg.buffer[:2]
    assert float(torch.linalg.vector_norm(added)) <= 0.5 + 1e-12
    assert added.tolist() == pytest.approx([0.3, 0.4], abs=0.01)  # clipped to 0.5, then 8-bit codes
    assert store.residual(0)["w"].tolist() == pytest.approx((torch.tensor([0.3, 0.4]) - added.float()).tolist(),
                                                            abs=1e-6)


# ---------------------------------------------------------------- adaptive clipping

def test_adaptive_noise_split_makes_the_two_mechanisms_one_of_sigma():
    """σ = 1, σ_b = 1: z_Δ = (1 − (2·1)^−2)^−1/2 = 1/√0.75; the accountant's ε of the composed
    round equals that of one Gaussian mechanism of σ = 1."""
    z, sb = split_noise(1.0, 1.0, 100)
    assert z == pytest.approx(1 / math.sqrt(0.75)) and sb == 1.0
    assert split_noise(2.0, None, 100) == (pytest.approx((2.0 ** -2 - 10.0 ** -2) ** -0.5), 5.0)  # σ_b = 0.05·100
    assert split_noise(1.0, None, 10)[1] == 1.0  # never below σ
    assert split_noise(0.0, None, 100) == (0.0, 0.0)
    s = Sampling("poisson", 1000, 0.1)
    composed = Accountant(s, round_event(s, z, sb), 1e-5).epsilon(50)
    single = Accountant(s, round_event(s, 1.0), 1e-5).epsilon(50)
    assert composed == pytest.approx(single, rel=1e-9)


def test_adaptive_clip_update_hand_computed():
    """C = 0.5, η = 0.2, γ = 0.5; no noise; m̄ = 4; three of four clients unclipped:
    b̃ = (3·½ − ½)/4 + ½ = 0.75 and C' = 0.5·exp(−0.2·0.25)."""
    cfg = dp_config(dp_clip="adaptive", dp_clip_init=0.5, dp_noise_multiplier=0.0, num_clients=4)
    dp = CentralDP(cfg, plan_run(cfg, 4))
    rec = dp.end_round(0, PrivacySums(unclipped_minus_half=1.0))
    assert rec["dp_unclipped_fraction"] == 0.75 and rec["dp_clip"] == 0.5
    assert dp.clip == pytest.approx(0.5 * math.exp(-0.05))
    assert dp.state_dict() == {"clip": dp.clip}
    other = CentralDP(cfg, plan_run(cfg, 4))
    other.load_state_dict(dp.state_dict())
    assert other.clip == dp.clip


@pytest.mark.parametrize("unclipped, lr, to", [
    (-0.5 * 4, 1e6, "inf"),  # b̃ = 0 < γ: a step of exp(5e5) overflows float64
    (1e6, 0.2, "0"),  # b̃ far above 1 (count noise of 1e6 clients): C underflows to 0
])
def test_an_adaptive_clip_update_out_of_float_range_stops_in_one_line(unclipped, lr, to):
    """The geometric update C·exp(−η_C(b̃ − γ)) ended in math.exp's OverflowError traceback after a
    round had trained, or drove C (and the noise σ·C) to where the clients were blamed for the
    non-finite model. The run now stops naming the update and the keys that drive it."""
    cfg = dp_config(dp_clip="adaptive", dp_clip_init=0.5, dp_noise_multiplier=0.0, dp_clip_lr=lr, num_clients=4)
    dp = CentralDP(cfg, plan_run(cfg, 4))
    with pytest.raises(UserError) as exc:
        dp.end_round(2, PrivacySums(unclipped_minus_half=unclipped))
    assert str(exc.value).startswith(f"dp_clip=adaptive: round 3's update would take the clip norm C from 0.5 to {to} ")
    assert str(exc.value).endswith("lower dp_clip_lr or dp_clip_count_stddev")
    assert dp.clip == 0.5  # left as it was (the last checkpoint's C)


@pytest.mark.parametrize("kw, key", [
    ({"dp_clip": 1e300}, "dp_clip"),
    ({"dp_clip": "adaptive", "dp_clip_init": 1e35}, "dp_clip_init"),
    ({"dp_noise_multiplier": 1e300}, "dp_noise_multiplier"),
])
def test_a_noise_no_float_holds_is_refused_before_start(kw, key):
    cfg = dp_config(num_clients=4, **kw)
    with pytest.raises(UserError, match=f"^config key '{key}': "):
        CentralDP(cfg, plan_run(cfg, 4))
    assert "a large dp_clip or σ can wreck it" in CentralDP(dp_config(num_clients=4), plan_run(
        dp_config(num_clients=4), 4)).nonfinite_hint()


@pytest.mark.parametrize("kw, key", [
    ({"participation": 0.5, "dp_noise_multiplier": 3e8}, "dp_noise_multiplier"),  # fixed cohorts: a math domain error
    ({"participation": 0.5, "dp_clip": "adaptive", "dp_noise_multiplier": 1e9}, "dp_noise_multiplier"),
    ({"participation": 0.5, "participation_sampling": "poisson", "dp_noise_multiplier": 1e50}, "dp_noise_multiplier"),
])
def test_a_noise_multiplier_beyond_the_accountant_or_float_is_refused_naming_it(kw, key):
    """The library's RDP routine for sampling without replacement fails with a ValueError ("math
    domain error") from about σ = 3e8 on, which left the run with a traceback (only σ = 1e300's
    OverflowError was caught); and σ·C beyond float32 named dp_clip (choose a smaller C) where σ
    was the value out of range."""
    cfg = dp_config(num_clients=20, **kw)
    with pytest.raises(UserError, match=f"^config key '{key}': ") as exc:
        CentralDP(cfg, plan_run(cfg, 20))
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("count_stddev", [1e9, 1e-300])
def test_a_calibration_the_accountant_cannot_compute_is_refused_in_one_line(count_stddev):
    """σ_b sets the calibration's upper end at 2σ_b, where the accountant fails: a ValueError at
    2e9 (fixed cohorts), an OverflowError at 2e-300; both were tracebacks."""
    cfg = dp_config(num_clients=20, participation=0.5, dp_clip="adaptive", dp_clip_count_stddev=count_stddev,
                    dp_target_epsilon=5.0, rounds=1)
    with pytest.raises(UserError, match="^config key 'dp_clip_count_stddev': calibrating σ for ε = 5 ") as exc:
        plan_run(cfg, 20)
    assert "leave it unset" in str(exc.value) and "\n" not in str(exc.value)


# ---------------------------------------------------------------- the accountant against the library

@pytest.mark.parametrize("kind", ["fixed", "poisson"])
def test_epsilon_is_the_librarys_own_value(kind):
    """ε after t rounds of the engine's accountant (built from the config, N = 1000, 100 a round,
    σ = 1, δ = 1e-5) against a fresh dp-accounting RdpAccountant composed t times with the event
    written out here: without replacement at replace-one adjacency (the sum's sensitivity 2C: the
    library gets σ/2), Poisson at add/remove."""
    cfg = dp_config(participation=0.1, participation_sampling=kind, dp_noise_multiplier=1.0, dp_delta=1e-5,
                    num_clients=1000)
    dp = CentralDP(cfg, plan_run(cfg, 1000))
    for t in (1, 7, 60):
        if kind == "fixed":
            acc = RdpAccountant(neighboring_relation=NR.REPLACE_ONE)
            acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(1000, 100, dp_accounting.GaussianDpEvent(0.5)), t)
        else:
            acc = RdpAccountant(neighboring_relation=NR.ADD_OR_REMOVE_ONE)
            acc.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), t)
        assert dp.accountant.epsilon(t) == acc.get_epsilon(1e-5)
    assert dp.accountant.epsilon(0) == 0.0
    assert 0 < dp.accountant.epsilon(1) < dp.accountant.epsilon(7) < dp.accountant.epsilon(60) < math.inf
    assert dp.end_round(6, PrivacySums())["dp_epsilon"] == dp.accountant.epsilon(7)


def test_no_noise_is_an_infinite_epsilon():
    cfg = dp_config(dp_noise_multiplier=0.0, num_clients=10)
    dp = CentralDP(cfg, plan_run(cfg, 10))
    assert dp.accountant.epsilon(3) == math.inf and "ε = ∞" in dp.epsilon_line(3)


def test_calibration_meets_the_target_within_tolerance():
    """σ for ε = 2 after 40 Poisson rounds at q = 0.1, δ = 1e-5: the library's ε at σ is at most 2
    and at 0.99·σ above it."""
    s = Sampling("poisson", 1000, 0.1)
    sigma = calibrate_noise(s, lambda z: round_event(s, z), 2.0, 40, 1e-5)
    assert epsilon_after(s, lambda z: round_event(s, z), sigma, 40, 1e-5) <= 2.0
    assert epsilon_after(s, lambda z: round_event(s, z), 0.99 * sigma, 40, 1e-5) > 2.0
    cfg = dp_config(participation=0.1, participation_sampling="poisson", dp_target_epsilon=2.0, rounds=40,
                    num_clients=1000)
    plan = plan_run(cfg, 1000)
    assert plan.calibrated and plan.sigma == sigma
    assert CentralDP(cfg, plan).accountant.epsilon(40) <= 2.0


# ---------------------------------------------------------------- Poisson cohorts

def test_poisson_cohorts_vary_in_size_and_follow_the_seed():
    sizes = [len(sample_cohort(4, t, 50, 0.2, sampling="poisson")) for t in range(400)]
    assert np.mean(sizes) == pytest.approx(10, abs=0.5) and min(sizes) < 6 and max(sizes) > 14
    assert np.array_equal(sample_cohort(4, 9, 50, 0.2, sampling="poisson"), sample_cohort(4, 9, 50, 0.2, sampling="poisson"))
    assert min(len(sample_cohort(1, t, 5, 0.1, sampling="poisson")) for t in range(50)) == 0  # an empty round
    counts = np.bincount(np.concatenate([sample_cohort(2, t, 20, 0.3, sampling="poisson") for t in range(1000)]),
                         minlength=20)
    assert np.allclose(counts / 1000, 0.3, atol=0.06)


# ---------------------------------------------------------------- refusals

def _refusal(**flat) -> str:
    with pytest.raises(UserError) as e:
        load_config(values=unflatten({"method": "fedavg", **flat}), validate=False).validate(data_file=False)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("flat,key,words", [
    ({"dp": "central", "dp_clip": 0}, "dp_clip", "> 0"),
    ({"dp": "central", "dp_clip": -1.0}, "dp_clip", "> 0"),
    ({"dp": "central", "dp_clip": "sometimes"}, "dp_clip", "adaptive"),
    ({"dp": "central", "dp_noise_multiplier": -0.5}, "dp_noise_multiplier", ">= 0"),
    ({"dp": "central", "dp_delta": 0.0}, "dp_delta", "(0, 1)"),
    ({"dp": "central", "dp_delta": 0.1, "data.num_clients": 20}, "dp_delta", "1/N"),
    ({"dp": "central", "dp_target_epsilon": 0.0}, "dp_target_epsilon", "> 0"),
    ({"dp": "central", "dp_target_epsilon": 2.0, "dp_noise_multiplier": 0.5}, "dp_noise_multiplier", "dp_target_epsilon"),
    ({"dp": "central", "dp_clip": "adaptive", "dp_clip_count_stddev": 0.4}, "dp_clip_count_stddev", "dp_noise_multiplier"),
    # no count noise beside a target: the calibration divided by σ_b = 0 (a ZeroDivisionError traceback)
    ({"dp": "central", "dp_clip": "adaptive", "dp_clip_count_stddev": 0.0, "dp_target_epsilon": 5.0},
     "dp_clip_count_stddev", "without noise"),
    ({"dp": "central", "dp_noise_cohort_size": 5, "participation": 0.5, "data.num_clients": 20},
     "dp_noise_cohort_size", "expected cohort"),
    ({"dp": "central", "participation_range": [0.2, 0.5]}, "participation_range", "dp=central"),
    ({"dp": "central", "method": "fedcp", "participation": 0.5, "client_selection": "feature_difference"},
     "client_selection", "dp=central"),
    ({"dp": "central", "method": "fedcp", "cpn_async_min_rate": 0.5}, "cpn_async_min_rate", "dp=central"),
    ({"dp": "central", "aggregate_bn_stats": True}, "aggregate_bn_stats", "dp=central"),
    ({"dp": "central", "method": "fedamp"}, "dp", "fedamp"),
    ({"dp": "central", "method": "fedfomo"}, "dp", "fedfomo"),
    ({"participation_sampling": "poisson", "participation_range": [0.2, 0.5]}, "participation_range", "poisson"),
])
def test_bad_values_are_refused_in_one_line_naming_the_key(flat, key, words):
    msg = _refusal(**flat)
    assert msg.startswith(f"config key '{key}'") and words in msg, msg


def test_keys_that_act_on_nothing_are_named_not_refused():
    """A DP key set while dp is none, or an adaptive-clipping key with a fixed clip norm, is accepted
    and named among the keys with no effect (the run's start line lists them); dp=central with
    adaptive clipping names none."""
    def idle(**flat):
        cfg = load_config(values=unflatten({"method": "fedavg", **flat}), validate=False).validate(data_file=False)
        return dict(cfg.keys_without_effect())

    assert idle(dp_clip=2.0, dp_target_epsilon=4.0) == {
        "dp_clip": "applies with dp=central only (dp is none)",
        "dp_target_epsilon": "applies with dp=central only (dp is none)"}
    assert idle(dp="central", dp_clip_lr=0.5, dp_clip_quantile=0.9) == {
        "dp_clip_quantile": "applies with dp_clip=adaptive only (dp_clip is 0.1)",
        "dp_clip_lr": "applies with dp_clip=adaptive only (dp_clip is 0.1)"}
    assert idle(dp="central", dp_clip="adaptive", dp_clip_lr=0.5, dp_clip_quantile=0.9) == {}
    # a noise cohort without noise scales nothing (and no output says its noise is a cohort's)
    assert idle(dp="central", dp_noise_multiplier=0.0, dp_noise_cohort_size=100) == {
        "dp_noise_cohort_size": "scales the noise, and there is none (dp_noise_multiplier is 0)"}
    assert idle(dp="central", dp_noise_multiplier=0.5, dp_noise_cohort_size=100) == {}
    assert idle(dp="central", dp_clip="adaptive", dp_clip_count_stddev=1.0, dp_noise_multiplier=0.0,
                dp_noise_cohort_size=100) == {}  # the count's noise is scaled
    assert not plan_run(dp_config(dp_noise_multiplier=0.0, dp_noise_cohort_size=100), 20).simulated_cohort
    assert plan_run(dp_config(dp_noise_multiplier=0.5, dp_noise_cohort_size=100), 20).simulated_cohort
    assert idle() == {}


def test_start_up_refuses_what_the_client_count_rules_out_and_an_unreachable_target():
    with pytest.raises(UserError, match="config key 'dp_delta'.*1/N = 1/20"):
        plan_run(dp_config(dp_delta=0.06), 20)
    with pytest.raises(UserError, match="config key 'dp_target_epsilon'.*not reachable in 10 rounds") as e:
        plan_run(dp_config(dp_target_epsilon=0.001, rounds=10, participation=0.5), 20)
    assert "\n" not in str(e.value)
    # a target that only the count noise's cap rules out names the key that sets the cap
    with pytest.raises(UserError, match=r"noise multiplier 1 \(it stays below 1: σ < 2·dp_clip_count_stddev, and "
                                        r"dp_clip_count_stddev is 0.5; raise it"):
        plan_run(dp_config(dp_clip="adaptive", dp_target_epsilon=5.0, dp_clip_count_stddev=0.5, dp_delta=0.01,
                           rounds=3), 20)
    assert plan_run(dp_config(dp_clip="adaptive", dp_target_epsilon=5.0, dp_delta=0.01, rounds=3), 20).sigma < 3


def test_the_start_line_says_when_the_noise_swamps_the_mean_update():
    """The noise on a round's mean update has norm z·C/m̄·√d: with the paper's 20 MNIST clients at
    ρ = 0.1 (an expected cohort of 2) and 1.1 M values it is about 1,000·C (the run diverges in ten
    rounds); the MNIST study's cohorts of 100 give about 10 and get no note."""
    d = 1_109_386
    small = CentralDP(dp_config(participation=0.1, dp_noise_multiplier=1.0), plan_run(
        dp_config(participation=0.1, dp_noise_multiplier=1.0), 20))
    note = small.swamped_note(d)
    assert f"{round(1.0 / 2 * d ** 0.5):,}·C" in note and "an expected cohort of 2" in note
    assert note in small.describe(10, "the model", "", d)
    study = dp_config(participation=0.1, dp_noise_multiplier=1.0)
    assert CentralDP(study, plan_run(study, 1000)).swamped_note(d) == ""  # 1.0/100·√d ≈ 10.5
    # the noise of a larger cohort, scaled to this run's (m̄/M), counts as what it adds here
    scaled = dp_config(participation=0.1, dp_noise_multiplier=1.0, dp_noise_cohort_size=1000)
    assert CentralDP(scaled, plan_run(scaled, 20)).swamped_note(d) == ""


def test_delta_written_as_1e_minus_5_is_a_number():
    """PyYAML reads 1e-5 (no dot) as a string; a key that takes a number reads it as 1e-05."""
    cfg = load_config(None, ["dp=central", "dp_delta=1e-5", "dp_clip=2e-1"], validate=False)
    assert cfg.dp_delta == 1e-5 and cfg.dp_clip == 0.2
    assert load_config(None, ["dp=central", "dp_clip=adaptive"], validate=False).dp_clip == "adaptive"


def test_rounds_may_not_change_on_resume_when_the_noise_was_calibrated_for_them():
    from fedcp_dist.rundir.directory import check_resume_config

    def flat(**kw):
        return Config(**{"method": "fedavg", "dp": "central", **kw}).to_dict()

    check_resume_config(flat(rounds=10), flat(rounds=20), "runs/x")  # a fixed σ: more rounds, a larger ε
    with pytest.raises(UserError, match="config key 'rounds'.*dp_target_epsilon calibrates"):
        check_resume_config(flat(rounds=10, dp_target_epsilon=2.0), flat(rounds=20, dp_target_epsilon=2.0), "runs/x")
