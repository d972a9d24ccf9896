"""A run's start-up: the shard checked against the config, the ranks agreeing on a failed start,
and the one build of the run's method that the engine and a rebuilt run share."""
import re
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from helpers import FakeRuntime
from fedcp_dist.engine import startup
from fedcp_dist.errors import UserError


CONFIG = str(REPO / "configs" / "digits_fedcp.yaml")


def test_shard_checks_name_the_key():
    info = SimpleNamespace(num_clients=20, source="digits", input_shape=(1, 28, 28), kind="image")
    cfg = SimpleNamespace(model="cnn", data=SimpleNamespace(num_clients=0, source="", input_shape=None, path="x.h5",
                                                            clients=None))
    startup.check_shard(cfg, info)
    for key, value, words in (("num_clients", 10, "holds 20 clients"), ("source", "mnist", "holds 'digits'"),
                              ("input_shape", [3, 32, 32], "shape [1, 28, 28]"),
                              ("clients", 21, "asks for 21 clients but x.h5 holds 20"),
                              ("clients", [3, 20], "lists client 20 but x.h5 holds clients 0..19")):
        bad = SimpleNamespace(model="cnn", data=SimpleNamespace(**{**vars(cfg.data), key: value}))
        with pytest.raises(UserError, match=rf"'data.{key}'.*{re.escape(words)}"):
            startup.check_shard(bad, info)
    # a model for another kind of shard: named, with the models that read this one
    with pytest.raises(UserError, match=r"'model': 'mlp' reads table shards but x.h5 holds image data \(model: cnn, resnet18\)"):
        startup.check_shard(SimpleNamespace(model="mlp", data=cfg.data), info)


def test_ranks_agree_on_a_failed_start():
    startup.agree(FakeRuntime(), None)
    with pytest.raises(UserError, match="another rank failed to start"):
        startup.agree(FakeRuntime(2, others=[torch.tensor([1.0])]), None)
    with pytest.raises(UserError, match="mine"):
        startup.agree(FakeRuntime(2, others=[torch.tensor([0.0])]), UserError("mine"))
    assert startup.all_ok(FakeRuntime(2, others=[torch.tensor([0.0])]), True)
    assert not startup.all_ok(FakeRuntime(2, others=[torch.tensor([1.0])]), True)


def test_the_engine_and_a_rebuilt_run_start_from_one_model(digits6, tmp_path, monkeypatch):
    """The engine and fedcp-analyze's rebuild of a run draw the seed, the model and the method through
    one function: the same initial global state, whatever was drawn before."""
    from fedcp_dist.analysis.runstate import load_run_state
    from helpers import run

    built, real = [], startup.build_method

    def spy(*args, **kw):
        torch.rand(len(built) + 3)  # draws before the build change nothing
        algo = real(*args, **kw)
        built.append({k: v.clone() for k, v in algo.init_global_state().items()})
        return algo

    monkeypatch.setattr(startup, "build_method", spy)
    run(CONFIG, [f"data.path={digits6}", "rounds=1", "checkpoint_every=1", f"out_dir={tmp_path}", "threads=1"])
    load_run_state(tmp_path)
    assert len(built) == 2 and set(built[0]) == set(built[1]) and "head.weight" in built[0]
    assert all(torch.equal(built[0][k], built[1][k]) for k in built[0])


def _cfg(*overrides):
    from fedcp_dist.config import load_config

    return load_config(None, list(overrides), validate=False).validate(data_file=False)


def test_keys_of_another_method_or_model_are_named_not_dropped():
    """A key that acts on another method or model is accepted (the run goes on as without it) and
    named as having no effect; another method's checks across its keys do not run for this one."""
    assert _cfg("method=fedavg", "lam=10").keys_without_effect() == [("lam", "an option of fedcp, not fedavg")]
    assert _cfg("method=fedcp", "prox_mu=10").keys_without_effect() == [("prox_mu", "an option of fedprox, not fedcp")]
    assert _cfg("model=cnn", "mlp_hidden=32", "fasttext_dim=8").keys_without_effect() == [
        ("mlp_hidden", "acts on model=mlp only"), ("fasttext_dim", "acts on model=fasttext only")]
    assert _cfg("method=fedavg", "peer_memory_mb=16").keys_without_effect() == [
        ("peer_memory_mb", "an option of fedamp, fedfomo, not fedavg")]
    # at their defaults, or acting on the method and model of the run: nothing to say
    assert _cfg("method=fedcp", "lam=10", "model=mlp", "mlp_hidden=32", "lr=0.1").keys_without_effect() == []
    assert _cfg("method=fedprox", "prox_mu=10", "lam=5.0").keys_without_effect() == []
    # FedCP's rule (a CPN key needs a CPN) is FedCP's: it refuses for FedCP only
    with pytest.raises(UserError, match="config key 'tau': acts on the CPN"):
        _cfg("method=fedcp", "fedcp_cpn=false", "tau=2")
    assert [k for k, _ in _cfg("method=fedavg", "fedcp_cpn=false", "tau=2").keys_without_effect()] == ["tau", "fedcp_cpn"]


def test_the_start_line_names_the_keys_without_effect(digits6, tmp_path):
    """A FedAvg run of the CNN given FedCP's λ, the MLP's width and aggregate_bn_stats (the CNN has
    no BatchNorm): it runs, and its first line names the three keys and why they act on nothing."""
    from helpers import run

    lines = []
    run(str(REPO / "configs" / "digits_fedavg.yaml"),
        [f"data.path={digits6}", "rounds=1", "checkpoint_every=0", f"out_dir={tmp_path}", "threads=1", "lam=10",
         "mlp_hidden=32", "aggregate_bn_stats=true"], echo=lines.append)
    first = lines[0]
    assert first.startswith("fedcp_dist: fedavg on 6 clients")
    assert first.endswith("; keys with no effect in this run: lam=10.0 (an option of fedcp, not fedavg), mlp_hidden=32 "
                          "(acts on model=mlp only), aggregate_bn_stats=True (the uploads hold no BatchNorm "
                          "statistics)")  # threads=1: no hint to add ranks follows
