"""FedCP composed of parts: combinations of its switches that once crashed now run (or are refused
in one line), and each part's options and checks are the ones the config walks."""
import json
import math

import pytest
import torch

from helpers import load_run, run
from fedcp_dist.algorithms import method_options, option_classes
from fedcp_dist.algorithms.fedcp import PARTS, FedCP
from fedcp_dist.config import load_config
from fedcp_dist.errors import UserError

DIGITS = "configs/digits_fedcp.yaml"


def _run(shard, out, *overrides):
    return run(DIGITS, [f"data.path={shard}", f"out_dir={out}", "overwrite=true", "threads=1", "eval_every=1",
                        *overrides])


def test_every_part_declares_options_the_config_walks():
    names = {o.name for o in method_options()}
    classes = option_classes()
    for part in PARTS:
        assert part in classes
        assert part.options and {o.name for o in part.options} <= names
    # no key is declared twice (method_options asserts it) and every key has one help text
    assert all(o.help for o in method_options())


def test_cached_policy_with_the_sample_only_input_runs(digits6, tmp_path):
    """Was: AssertionError 'upload keys differ from the aggregation spec' (the ablation's upload keys
    kept Θ_prev)."""
    summary = _run(digits6, tmp_path, "rounds=3", "cpn_input=sample", "policy_refresh_every=2")
    state, accs, records = load_run(tmp_path)
    assert math.isfinite(summary["best_acc"]) and len(records) == 3
    # round 2 (t = 2) is a refresh: Θ_prev is the Θ before it, which round 1 (frozen) left as round 0 made it
    assert {k for k in state if k.startswith("prev.")} == {"prev." + k for k in state if k.startswith("cpn.")}
    assert any(not torch.equal(state[k], state["prev." + k]) for k in state if k.startswith("cpn."))


def test_cached_policy_with_a_batchnorm_cpn_keeps_each_clients_statistics(digits6, tmp_path):
    """Was: KeyError 'prev.cpn.net.1.running_mean' (client store), then 'cpn.net.1.running_mean' in rounds
    that send no CPN: a frozen CPN keeps the client's statistics as they were."""
    summary = _run(digits6, tmp_path, "rounds=3", "cpn_norm=batchnorm", "policy_refresh_every=2", "checkpoint_every=1")
    state, _, records = load_run(tmp_path)
    assert math.isfinite(summary["best_acc"]) and len(records) == 3
    assert "cpn.net.1.running_mean" in state and "prev.cpn.net.1.running_mean" not in state  # a client's own
    assert "prev.cpn.net.0.weight" in state


@pytest.mark.parametrize("vector", ["head+stats", "head+embed"])
def test_probes_with_an_extended_client_vector(digits6, tmp_path, vector):
    """Was: KeyError 'stats' (the probes' loss built the policy input without s_i)."""
    _run(digits6, tmp_path, "rounds=2", "analysis=true", f"cpn_client_vector={vector}")
    rows = [json.loads(l) for l in (tmp_path / "analysis.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert {r["round"] for r in train} == {1, 2} and len(train) == 12  # 6 clients, both rounds
    assert all(math.isfinite(r["loss_bef"]) and math.isfinite(r["loss_aft"]) and r["loss_bef"] > 0 for r in train)


@pytest.mark.parametrize("overrides,key", [
    (["fedcp_cpn=false", "cpn_layers=2"], "cpn_layers"),
    (["fedcp_cpn=false", "tau=0.5"], "tau"),
    (["fedcp_gfm=false", "mmd_kernel=rbf"], "mmd_kernel"),
    (["cpn_embed_dim=4"], "cpn_embed_dim"),
    (["policy_refresh_every=2", "cpn_async_min_rate=0.5"], "cpn_async_min_rate"),
    (["cpn_upload_every=2", "compress=topk"], "cpn_upload_every"),
])
def test_switches_a_part_cannot_honour_are_refused_naming_the_key(digits6, overrides, key):
    with pytest.raises(UserError) as exc:
        load_config(DIGITS, [f"data.path={digits6}", *overrides])
    assert f"'{key}'" in str(exc.value) and "\n" not in str(exc.value)


def test_ablations_are_options_of_one_class(digits6):
    from fedcp_dist.algorithms import make_algorithm
    from fedcp_dist.models import build_model

    cfg = load_config(DIGITS, [f"data.path={digits6}", "fedcp_cpn=false", "fedcp_gfm=false", "fedcp_global_head=false"])
    algo = make_algorithm("fedcp", cfg, build_model("cnn", (1, 28, 28), 10), torch.device("cpu"))
    assert type(algo) is FedCP and algo.terms[0].lam == 0.0
    gs = algo.init_global_state()
    assert algo.upload_keys(gs) == [k for k in gs if k.startswith("features.")]
