"""FedCP's practitioner switches (issue 13, items 6, 9, 7) on small hand-computed numbers: policy
caching (policy_refresh_every), federated policy distillation with skipped CPN uploads
(cpn_distill, cpn_upload_every), the hierarchical policy (cpn_groups); fused training equals
sequential training with them on; one 1-vs-2-rank run with all of them, which also resumes
bit-exactly."""
import json
import shutil
import sys

import pytest
import torch

from conftest import run_cmd
from helpers import algo_with_moved_global, random_client, run, tiny_data
from test_fedcp_extensions import _tiny_fedcp
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import PREV, FedCP, interpolate, refresh_alpha
from fedcp_dist.config import load_config
from fedcp_dist.errors import UserError


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
    algo, gs = _tiny_fedcp(policy_refresh_every=3, cpn_client_vector=vector)
    keys = _policy_keys(gs)
    assert keys and all(PREV + k in gs for k in keys) and not any(k.startswith(PREV) for k in algo.upload_keys(gs))
    d = tiny_data(n=16)
    for t in range(4):
        res = algo.local_train(algo.init_client_state(0), d, _ctx(t, probe=True))
        trained = res.extra["trained"]
        if t % 3 == 0:  # refresh: trained from Θ_last and uploaded
            assert all(not torch.equal(res.upload[k], gs[k]) for k in keys if k.endswith("weight")), t
            assert algo.uplink_saved_params(t) == 0
        else:  # frozen at Θ_prev + (t mod 3)/3 (Θ_last − Θ_prev); the upload's slot holds Θ_last unchanged
            a = (t % 3) / 3
            for k in keys:
                assert torch.equal(trained[k], gs[PREV + k] + a * (gs[k] - gs[PREV + k])), (t, k)
                assert torch.equal(res.upload[k], gs[k]), (t, k)
            assert algo.uplink_saved_params(t) == sum(gs[k].numel() for k in keys)
        assert not torch.equal(res.upload["features.1.weight"], gs["features.1.weight"])


def test_refresh_server_update_and_evaluated_policy():
    algo, gs = _tiny_fedcp(policy_refresh_every=2)
    keys = _policy_keys(gs)
    avg = {k: v + 1.0 for k, v in gs.items() if not k.startswith(PREV)}
    algo.begin_round(0)  # a refresh: Θ_prev ← Θ_last, Θ_last ← the mean
    new = algo.server_update(gs, avg)
    for k in keys:
        assert torch.equal(new[PREV + k], gs[k]) and torch.equal(new[k], avg[k])
    assert torch.equal(new["features.1.weight"], avg["features.1.weight"])
    algo.begin_round(1)  # between refreshes: both kept whatever arrived
    newer = algo.server_update(new, {k: v + 5.0 for k, v in avg.items()})
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
