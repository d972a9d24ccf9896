"""The contributing guide's worked example (docs/contributing.md, "How to add a method") runs as
written: the FedLS method registered, its key in the config, its preset generated from its
declarations, its loss the label-smoothed cross-entropy torch computes, and its clients trained
fused as they are sequentially."""
import re
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO
from fedcp_dist.algorithms.base import Context
from fedcp_dist.local_train import Step


def _example():
    text = (REPO / "docs" / "contributing.md").read_text()
    code = re.search(r"```python\n(\"\"\"FedLS: .*?)```", text, re.S).group(1)
    module = types.ModuleType("fedls_example")
    exec(compile(code, "docs/contributing.md (FedLS)", "exec"), module.__dict__)
    return module.FedLS


@pytest.fixture
def fedls(monkeypatch):
    """FedLS registered as step 2 of the guide has it (and the Config rebuilt with its key)."""
    import fedcp_dist.algorithms as algorithms
    from fedcp_dist import config

    cls = _example()
    monkeypatch.setitem(algorithms.ALGORITHMS, "fedls", cls)
    monkeypatch.setattr(algorithms, "OPTION_CLASSES", (*algorithms.OPTION_CLASSES, cls))
    monkeypatch.setattr(config, "Config", config._assemble_config())
    return cls


def test_the_worked_example_registers_configures_and_has_its_preset(fedls):
    from fedcp_dist.cli.config_reference import preset
    from fedcp_dist.config import load_config

    cfg = load_config(None, ["method=fedls", "fedls_eps=0.2"], validate=False).validate(data_file=False)
    assert cfg.method_class is fedls and cfg.fedls_eps == 0.2
    assert load_config(None, ["method=fedavg", "fedls_eps=0.2"], validate=False).validate(
        data_file=False).keys_without_effect() == [("fedls_eps", "an option of fedls, not fedavg")]
    text = preset("fedls")
    assert "\nmethod: fedls\n" in text and "\nfedls_eps: 0.1\nout_dir: runs/digits_fedls\n" in text


def test_the_worked_examples_loss_is_label_smoothing_and_trains_fused_as_sequentially(fedls, float64):
    from fedcp_dist.config import Config
    from fedcp_dist.fused.groups import train_group
    from helpers import random_client

    cfg = Config(method="fedls", fedls_eps=0.2, lr=0.05, batch_size=10, local_epochs=2)
    torch.manual_seed(0)
    from fedcp_dist.models import build_model

    algo = fedls(cfg, build_model("cnn", (1, 16, 16), 10), torch.device("cpu"))
    gs = {k: v + 0.01 for k, v in algo.init_global_state().items()}
    algo.set_global(gs)
    datas = [random_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate((23, 7, 31))]
    x, y = datas[0].train_batch(torch.arange(10))
    step = Step(x, y, algo.train_phase.modules, {}, torch.Generator())
    logits = algo.model(x)
    assert torch.allclose(algo.loss(step), F.cross_entropy(logits, y, label_smoothing=0.2), atol=1e-12)

    assert algo.fused_reason() is None
    items = [(None, d, Context(1, d.cid, torch.Generator().manual_seed(5 + d.cid))) for d in datas]
    fused = train_group(algo, items)
    for (_, d, c), f in zip(items, fused):
        s = algo.local_train(None, d, Context(1, d.cid, torch.Generator().manual_seed(5 + d.cid)))
        assert f.samples == s.samples and set(f.upload) == set(s.upload)
        assert all(torch.allclose(f.upload[k], s.upload[k], atol=1e-12, rtol=0) for k in s.upload)
        assert any((s.upload[k] - gs[k]).abs().max() > 1e-3 for k in s.upload)  # it trained
