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
