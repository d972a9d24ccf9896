"""The three models (4-layer CNN, ResNet-18, fastText): shapes, the feature/head split, parameter
counts, fastText's masked mean; then every method on every model through the algorithm API, and
what BatchNorm asks of the methods (evaluation per sample, no client's work leaking into another's)."""
import sys
import copy
import math

import pytest
import torch
import torchvision
from torch import nn

from conftest import run_cmd
from fedcp_dist.algorithms import ALGORITHMS, make_algorithm
from fedcp_dist.algorithms.base import Context, copy_module, load_module, module_state
from fedcp_dist.config import METHODS, Config, DataConfig
from fedcp_dist.models import MODELS, build_model, forward_batch_stats, mode_dependent
from fedcp_dist.models.cnn import CNN
from fedcp_dist.models.fasttext import FastText, MeanEmbedding
from fedcp_dist.models.resnet import ResNet18

CPU = torch.device("cpu")
METHOD_NAMES = [m for m in METHODS if m in ALGORITHMS]
NUM_CLASSES = 3
VOCAB = 50
MAX_LEN = 12
#: per model: the input shape of the algorithm tests (ResNet-18 on tiny 32x32 images to stay fast)
SHAPES = {"cnn": (1, 28, 28), "resnet18": (3, 32, 32), "fasttext": (MAX_LEN,), "mlp": (6,)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these small ResNet-18 steps run no faster on more, and far slower on busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class FakeClient:
    """The client-data interface the methods use (as ClientData): tensors already model-ready."""

    def __init__(self, train_x, train_y, test_x, test_y):
        self.train_x, self.train_y, self.test_x, self.test_y = train_x, train_y, test_x, test_y

    @property
    def n_train(self):
        return int(self.train_y.shape[0])

    @property
    def n_test(self):
        return int(self.test_y.shape[0])

    def train_batch(self, idx=None):
        if idx is None:
            return self.train_x, self.train_y
        return self.train_x[idx], self.train_y[idx]

    def test_batch(self, start, stop):
        return self.test_x[start:stop], self.test_y[start:stop]


def _inputs(model: str, n: int, g: torch.Generator) -> torch.Tensor:
    if model == "fasttext":
        ids = torch.randint(1, VOCAB, (n, MAX_LEN), generator=g)
        lengths = torch.randint(1, MAX_LEN + 1, (n,), generator=g)
        return ids.masked_fill(torch.arange(MAX_LEN)[None, :] >= lengths[:, None], 0)  # right-padded
    return torch.randn(n, *SHAPES[model], generator=g)


def _client(model: str, seed: int = 0, n_train: int = 8, n_test: int = 3) -> FakeClient:
    g = torch.Generator().manual_seed(seed)
    train_y = torch.arange(n_train) % NUM_CLASSES
    return FakeClient(_inputs(model, n_train, g), train_y, _inputs(model, n_test, g), torch.arange(n_test) % NUM_CLASSES)


def _build(model: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(model, SHAPES[model], NUM_CLASSES, vocab_size=VOCAB if model == "fasttext" else 0)


def _algorithm(method: str, model: str, **kw):
    kw = {"lr": 0.01, "batch_size": 4, "fedrep_head_epochs": 1, "pfedme_k": 2, "ditto_epochs": 1, **kw}
    cfg = Config(method=method, model=model, data=DataConfig(num_clients=2), **kw)
    algo = make_algorithm(method, cfg, _build(model), CPU)
    gs = algo.init_global_state()
    algo.set_global(gs)
    return algo, gs


def _ctx(client=0, seed=1, rnd=0):
    return Context(rnd, client, torch.Generator().manual_seed(seed))


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------------------------
# build_model


def test_build_model_knows_the_config_models():
    from fedcp_dist.models import ModelChoice

    model_key = next(o for o in ModelChoice.options if o.name == "model")  # the config key's declaration
    assert MODELS == ("cnn", "resnet18", "fasttext", "mlp", "lstm")
    assert all(model_key.check(m) is None for m in MODELS) and model_key.check("vgg") is not None
    assert isinstance(build_model("cnn", (1, 28, 28), 10), CNN)
    assert isinstance(build_model("resnet18", [3, 32, 32], 10), ResNet18)
    assert isinstance(build_model("fasttext", [200], 4, vocab_size=VOCAB), FastText)
    mlp = build_model("mlp", [6], 2, mlp_hidden=5)
    # Linear(6, 5) + Linear(5, 5) features, K = 5, head Linear(5, 2): 35 + 30 + 12 parameters
    assert mlp.feature_dim == 5 and _count(mlp.features) == 65 and _count(mlp.head) == 12
    assert mlp(torch.zeros(3, 6)).shape == (3, 2) and mlp.input_kind == "table"


@pytest.mark.parametrize(
    "name,shape,kw,match",
    [
        ("resnet18", (1, 28, 28), {}, "3-channel"),
        ("resnet18", (200,), {}, r"images \[C, H, W\]"),
        ("cnn", (200,), {}, r"images \[C, H, W\]"),
        ("fasttext", (3, 32, 32), {"vocab_size": VOCAB}, r"token ids \[max_len\]"),
        ("fasttext", (200,), {}, "vocab_size=0"),
        ("fasttext", (200,), {"vocab_size": -3}, "vocab_size=-3"),
        ("vgg", (3, 32, 32), {}, "unknown model 'vgg'"),
        ("mlp", (3, 32, 32), {}, r"feature rows \[features\]"),
        ("lstm", (1, 28, 28), {"vocab_size": 80}, r"character ids \[sequence length\]"),
        ("lstm", (80,), {}, "vocab_size=0"),
        ("lstm", (80,), {"vocab_size": 80, "lstm_hidden": 0}, "lstm_hidden >= 1"),
        ("cnn", (1, 28, 28), {"num_classes": 0}, "num_classes=0"),
    ],
)
def test_build_model_refuses_what_it_cannot_build(name, shape, kw, match):
    kw = {"num_classes": 10, **kw}
    with pytest.raises(ValueError, match=match):
        build_model(name, shape, **kw)


# ----------------------------------------------------------------------------------------------
# the 4-layer CNN


@pytest.mark.parametrize("shape,flat", [((1, 28, 28), 1024), ((3, 32, 32), 1600), ((3, 64, 64), 10816)])
def test_cnn_sizes_itself_from_the_input(shape, flat):
    torch.manual_seed(0)
    model = build_model("cnn", shape, 10)
    assert model.flat_dim == flat and model.features[7].in_features == flat
    x = torch.randn(2, *shape)
    h = model.features(x)
    assert h.shape == (2, 512) and model.feature_dim == 512
    assert torch.equal(model.head(h), model(x))
    assert model(x).shape == (2, 10)
    c = shape[0]
    expected = (c * 25 * 32 + 32) + (32 * 25 * 64 + 64) + (flat * 512 + 512) + (512 * 10 + 10)
    assert _count(model) == expected
    assert not mode_dependent(model)


# ----------------------------------------------------------------------------------------------
# ResNet-18


def _resnet18_backbone_params() -> int:
    """Parameters of ResNet-18 without its fc, counted from the architecture."""
    bn = lambda c: 2 * c  # noqa: E731  (weight and bias)
    conv3 = lambda i, o: 9 * i * o  # noqa: E731

    def block(i, o):
        n = conv3(i, o) + bn(o) + conv3(o, o) + bn(o)
        return n + (i * o + bn(o) if i != o else 0)  # 1x1 downsample where the width changes

    total = 3 * 64 * 49 + bn(64)  # 7x7 stem
    for i, o in ((64, 64), (64, 128), (128, 256), (256, 512)):
        total += block(i, o) + block(o, o)
    return total


def test_resnet18_parameter_count():
    model = build_model("resnet18", (3, 64, 64), 200)
    assert _resnet18_backbone_params() == 11_176_512
    assert _count(model.features) == 11_176_512
    assert _count(model.head) == 512 * 200 + 200
    assert _count(model) == 11_279_112
    assert model.feature_dim == 512 and model.head.in_features == 512 and model.head.out_features == 200


def test_resnet18_is_torchvisions_network_split_without_copies():
    torch.manual_seed(3)
    reference = torchvision.models.resnet18(weights=None, num_classes=7).eval()
    torch.manual_seed(3)
    model = build_model("resnet18", (3, 32, 32), 7).eval()
    # the unmodified stem: 7x7 stride-2 convolution, BatchNorm, ReLU, 3x3 stride-2 max-pool
    stem = model.features[0]
    assert isinstance(stem, nn.Conv2d) and stem.kernel_size == (7, 7) and stem.stride == (2, 2)
    assert isinstance(model.features[1], nn.BatchNorm2d) and isinstance(model.features[3], nn.MaxPool2d)
    assert model.features[3].stride == 2
    # features and head share the modules: every parameter appears once
    ids = [id(p) for p in model.parameters()]
    assert len(ids) == len(set(ids))
    assert {id(p) for p in model.features.parameters()} | {id(p) for p in model.head.parameters()} == set(ids)
    assert model.head is model._modules["head"] and isinstance(model.head, nn.Linear)

    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        h = model.features(x)
        assert h.shape == (2, 512)
        out = model(x)
        assert torch.equal(model.head(h), out)
        assert torch.equal(out, reference(x))  # same initialisation, same forward
        assert model(torch.randn(3, 3, 64, 64)).shape == (3, 7)


def test_resnet18_batchnorm_state():
    model = build_model("resnet18", (3, 32, 32), 5)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 20
    # momentum 0.1 everywhere: num_batches_tracked (not in module_state: int64) is never read
    assert all(m.momentum == 0.1 for m in bns)
    state = module_state("", model)
    assert "features.1.running_mean" in state and "features.1.running_var" in state
    assert not any(k.endswith("num_batches_tracked") for k in state)
    assert len(state) == len(list(model.parameters())) + 2 * len(bns)
    # a training step moves the running statistics; load_module / copy_module carry them across
    model.train()
    with torch.no_grad():
        model(torch.randn(4, 3, 32, 32) * 3 + 1)
    moved = module_state("", model)
    assert not torch.equal(moved["features.1.running_mean"], state["features.1.running_mean"])
    other = build_model("resnet18", (3, 32, 32), 5)
    copy_module(other, model)
    assert all(torch.equal(t, moved[k]) for k, t in module_state("", other).items())
    load_module(other, state, "")
    assert all(torch.equal(t, state[k]) for k, t in module_state("", other).items())
    assert int(other.features[1].num_batches_tracked) == 0  # the counter is left alone


def test_forward_batch_stats_has_no_side_effect():
    torch.manual_seed(0)
    fe = build_model("resnet18", (3, 32, 32), 5).features.eval()
    before = {k: v.clone() for k, v in fe.state_dict().items()}
    x = torch.randn(4, 3, 32, 32)
    out = forward_batch_stats(fe, x)
    assert not fe.training and not out.requires_grad
    assert all(torch.equal(v, before[k]) for k, v in fe.state_dict().items())  # counters included
    train_copy = copy.deepcopy(fe).train()
    with torch.no_grad():
        assert torch.equal(out, train_copy(x))  # batch statistics
        assert not torch.allclose(out, fe(x))  # not the running statistics
    # a module without BatchNorm is just called
    cnn = build_model("cnn", (1, 28, 28), 3).features
    y = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(forward_batch_stats(cnn, y), cnn(y))


# ----------------------------------------------------------------------------------------------
# fastText


def test_fasttext_shapes_split_and_count():
    model = build_model("fasttext", [20], 4, vocab_size=VOCAB)
    ids = torch.randint(0, VOCAB, (5, 20))
    h = model.features(ids)
    assert h.shape == (5, 32) and model.feature_dim == 32
    assert torch.equal(model.head(h), model(ids)) and model(ids).shape == (5, 4)
    assert _count(model) == VOCAB * 32 + (32 * 32 + 32) + (32 * 4 + 4)
    emb = model.features[0].embedding
    assert emb.padding_idx == 0 and torch.equal(emb.weight[0], torch.zeros(32))
    # exactly Embedding-mean → Linear(32, 32): no nonlinearity before the head
    assert [type(m) for m in model.features] == [MeanEmbedding, nn.Linear]
    assert not mode_dependent(model)


def test_fasttext_mean_ignores_padding():
    # fasttext_mean: tokens, this project's first variant (the default, padded: test_fasttext_ref.py)
    pool = MeanEmbedding(10, dim=2, mean="tokens")
    with torch.no_grad():
        pool.embedding.weight.copy_(torch.tensor([[100.0, -100.0]] + [[float(i), float(-2 * i)] for i in range(1, 10)]))
    ids = torch.tensor([
        [3, 5, 0, 0],  # (e3 + e5) / 2 = (4, -8)
        [0, 0, 0, 0],  # all padding: zero, not NaN
        [7, 0, 7, 2],  # (2·e7 + e2) / 3 = (16/3, -32/3): a padding id in the middle is skipped too
        [9, 9, 9, 9],
    ])
    expected = torch.tensor([[4.0, -8.0], [0.0, 0.0], [16 / 3, -32 / 3], [9.0, -18.0]])
    assert torch.allclose(pool(ids), expected, atol=1e-6)

    model = FastText(10, 3, dim=2, mean="tokens")
    model.features[0].load_state_dict(pool.state_dict())
    with torch.no_grad():
        model.features[1].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        model.features[1].bias.copy_(torch.tensor([0.5, -0.5]))
    h = model.features(ids)
    assert torch.allclose(h, expected + torch.tensor([0.5, -0.5]), atol=1e-6)
    assert (h < 0).any()  # negative features survive: no ReLU


def test_fasttext_padding_row_gets_no_gradient():
    model = build_model("fasttext", [6], 2, vocab_size=VOCAB)
    ids = torch.tensor([[4, 8, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0]])
    loss = nn.functional.cross_entropy(model(ids), torch.tensor([0, 1]))
    (g,) = torch.autograd.grad(loss, [model.features[0].embedding.weight])
    assert torch.equal(g[0], torch.zeros(32)) and g[4].abs().sum() > 0 and g[9].abs().sum() == 0


# ----------------------------------------------------------------------------------------------
# every method on every model, through the algorithm API


def _changed(before: dict, after: dict) -> list:
    return [k for k in after if k in before and not torch.equal(before[k], after[k])]


@pytest.mark.parametrize("model", ["cnn", "resnet18", "fasttext", "mlp"])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_method_trains_and_evaluates_every_model(method, model):
    algo, gs = _algorithm(method, model)
    data = _client(model)
    cs = algo.init_client_state(0)
    cs_before = None if cs is None else {k: v.clone() for k, v in cs.items()}
    res = algo.local_train(cs, data, _ctx())

    assert sorted(res.upload) == sorted(algo.upload_keys(gs))
    for k, t in res.upload.items():
        assert t.shape == gs[k].shape and t.dtype == gs[k].dtype and torch.isfinite(t).all(), k
    assert math.isfinite(res.loss_sum) and res.samples > 0
    # something the method trains has moved: the upload, or the client's own model
    moved = _changed(gs, res.upload) + ([] if cs_before is None or res.client_state is None else _changed(cs_before, res.client_state))
    assert any(k.endswith("weight") for k in moved), moved

    state = algo.prepare_eval(res.client_state, data, _ctx(seed=5))
    with torch.no_grad():
        logits = algo.predict(state, data.test_batch(0, data.n_test)[0], _ctx(seed=5))
    assert logits.shape == (data.n_test, NUM_CLASSES) and torch.isfinite(logits).all()


def _snapshot(res):
    return {**{f"up/{k}": v.clone() for k, v in res.upload.items()},
            **{f"cs/{k}": v.clone() for k, v in (res.client_state or {}).items()}}


def _eval(algo, state, data, seed=7):
    s = algo.prepare_eval(state, data, _ctx(seed=seed))
    with torch.no_grad():
        return algo.predict(s, data.test_x, _ctx(seed=seed))



@pytest.mark.parametrize("method", METHOD_NAMES)
def test_batchnorm_keeps_clients_apart_and_evaluates_per_sample(method):
    """ResNet-18: a client's training and evaluation do not depend on which clients the rank ran
    before, and evaluation is per sample (running statistics, not the test batch's)."""
    a, b = _client("resnet18", seed=1, n_train=4), _client("resnet18", seed=2, n_train=4)
    fresh, _ = _algorithm(method, "resnet18")
    res_b = fresh.local_train(fresh.init_client_state(1), b, _ctx(client=1, seed=11))
    eval_b = _eval(fresh, res_b.client_state, b)

    busy, _ = _algorithm(method, "resnet18")
    _eval(busy, busy.init_client_state(0), a)  # evaluation of another client first ...
    busy.local_train(busy.init_client_state(0), a, _ctx(client=0, seed=10))  # ... and its training
    res_b2 = busy.local_train(busy.init_client_state(1), b, _ctx(client=1, seed=11))
    snap, snap2 = _snapshot(res_b), _snapshot(res_b2)
    assert snap.keys() == snap2.keys()
    for k in snap:
        assert torch.allclose(snap[k], snap2[k], atol=1e-6, rtol=0), k
    assert torch.allclose(_eval(busy, res_b2.client_state, b), eval_b, atol=1e-5, rtol=1e-5)

    # per sample: the first test sample alone gets the logits it gets within the batch
    s = busy.prepare_eval(res_b2.client_state, b, _ctx(seed=7))
    with torch.no_grad():
        whole = busy.predict(s, b.test_x, _ctx(seed=7))
        alone = busy.predict(s, b.test_x[:1], _ctx(seed=7))
    assert torch.allclose(alone, whole[:1], atol=1e-4, rtol=1e-4)  # batch-size-dependent kernels round differently


# ----------------------------------------------------------------------------------------------
# method details that BatchNorm exposes


def test_fedrep_runs_a_batchnorm_extractor_on_every_head_batch():
    algo, gs = _algorithm("fedrep", "resnet18", fedrep_head_epochs=1, local_epochs=1)
    data = _client("resnet18")
    calls = []
    algo.model.features.register_forward_hook(lambda m, i, o: calls.append(m.training))
    res = algo.local_train(algo.init_client_state(0), data, _ctx())
    # 2 head batches + 2 extractor batches, all in training mode (no precomputed features)
    assert calls == [True] * 4
    assert res.samples == 16
    # the extractor's running statistics follow all four batches
    assert not torch.equal(res.upload["features.1.running_mean"], gs["features.1.running_mean"])
    # without BatchNorm the features are computed once (one chunk) for the head epochs
    algo_cnn, _ = _algorithm("fedrep", "cnn", fedrep_head_epochs=3)
    calls_cnn = []
    algo_cnn.model.features.register_forward_hook(lambda m, i, o: calls_cnn.append(m.training))
    algo_cnn.local_train(algo_cnn.init_client_state(0), _client("cnn"), _ctx())
    assert len(calls_cnn) == 1 + 2


def test_pfedme_uploads_theta_batchnorm_statistics():
    algo, gs = _algorithm("pfedme", "resnet18")
    res = algo.local_train(algo.init_client_state(0), _client("resnet18"), _ctx())
    key = "features.1.running_mean"
    assert not torch.equal(res.upload[key], gs[key])
    assert torch.equal(res.upload[key], res.client_state[key])
    assert torch.equal(res.upload["features.1.running_var"], res.client_state["features.1.running_var"])
    # the parameters stay w's, not θ's
    assert not torch.equal(res.upload["features.0.weight"], res.client_state["features.0.weight"])


def test_perfedavg_adapts_in_training_mode_whatever_ran_before():
    algo, gs = _algorithm("perfedavg", "resnet18")
    data = _client("resnet18")
    first = algo.prepare_eval(None, data, _ctx(seed=4))
    with torch.no_grad():
        algo.predict(first, data.test_x, _ctx(seed=4))  # leaves the working model in eval mode
    again = algo.prepare_eval(None, data, _ctx(seed=4))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["features.1.running_mean"], gs["features.1.running_mean"])  # a training step


def test_fedphp_mmd_target_leaves_the_inherited_model_alone():
    algo, gs = _algorithm("fedphp", "resnet18", fedphp_lam=0.5)
    cs = algo.init_client_state(0)
    modes = []
    algo.hpm.features[1].register_forward_hook(lambda m, i, o: modes.append(m.training))
    res = algo.local_train(cs, _client("resnet18"), _ctx())
    # the MMD target normalises by the batch's statistics, as the local features do (2 batches) ...
    assert modes == [True, True] and not algo.hpm.training and not algo.hpm.features[1].training
    # the HPM was loaded from the client's state and its buffers were not moved by the MMD target
    assert all(torch.equal(t, cs[f"hpm.{k}"]) for k, t in module_state("", algo.hpm).items())
    assert math.isfinite(res.loss_sum)


# ----------------------------------------------------------------------------------------------
# one FedCP round of ResNet-18


def test_fedcp_round_with_resnet18():
    algo, gs = _algorithm("fedcp", "resnet18", lr=0.05)
    assert algo.K == 512 and algo.cpn.net[0].in_features == 512
    head_g = {k: v.clone() for k, v in module_state("head.", algo.head_g).items()}
    assert all(not p.requires_grad for p in algo.head_g.parameters())
    data = _client("resnet18")
    cs = algo.init_client_state(0)
    res = algo.local_train(cs, data, _ctx())

    assert math.isfinite(res.loss_sum) and res.samples == 8
    assert sorted(res.upload) == sorted(gs)
    # the extractor and the CPN trained; the global head stayed frozen
    assert _changed(gs, res.upload)
    assert {k for k in _changed(gs, res.upload) if k.startswith("features.")}
    assert "cpn.net.0.weight" in _changed(gs, res.upload)
    assert all(torch.equal(t, head_g[k]) for k, t in module_state("head.", algo.head_g).items())
    # the personal head trained, and the uploaded head is the mean of the global and the personal one
    assert not torch.equal(res.client_state["head.weight"], cs["head.weight"])
    for k in ("head.weight", "head.bias"):
        assert torch.allclose(res.upload[k], 0.5 * (gs[k] + res.client_state[k]), atol=1e-7)
    assert torch.equal(res.client_state["v"], res.client_state["head.weight"].sum(0))

    # the server's step with this one client, then evaluation with the new global extractor
    new = algo.server_update(gs, {k: res.upload[k] for k in algo.upload_keys(gs)})
    algo.set_global(new)
    assert torch.equal(algo.fe_g[0].weight, new["features.0.weight"])
    logits = algo.predict(res.client_state, data.test_x, _ctx(seed=9))
    assert logits.shape == (3, NUM_CLASSES) and torch.isfinite(logits).all()


# -- a model that cannot take the shard's inputs --------------------------------------------------

def _shard_cfg(shard, **kw):
    from fedcp_dist.config import load_config

    return load_config("configs/digits_fedcp.yaml", [f"data.path={shard}", *(f"{k}={v}" for k, v in kw.items())])


def test_model_for_shard_names_the_model_and_the_inputs(digits6, monkeypatch):
    import dataclasses

    from fedcp_dist.engine import startup
    from fedcp_dist.data.shards import read_info
    from fedcp_dist.errors import UserError

    info = read_info(str(digits6))
    # the constructor refuses: 1-channel images for ResNet-18, images for fastText, too small for the CNN
    for model, info_, words in [
        ("resnet18", info, ["'resnet18'", "digits images of shape [1, 28, 28]", "3-channel"]),
        ("fasttext", info, ["'fasttext'", "[1, 28, 28]", "token ids"]),
        ("cnn", dataclasses.replace(info, input_shape=(1, 8, 8)), ["'cnn'", "[1, 8, 8]", "too small"]),
    ]:
        with pytest.raises(UserError) as exc:
            startup.model_for_shard(_shard_cfg(digits6, model=model), info_)
        msg = str(exc.value)
        assert msg.startswith("config key 'model': ") and "\n" not in msg and str(digits6) in msg, msg
        for w in words:
            assert w in msg, msg

    # the constructor accepts but the forward pass fails (a model sized for other inputs)
    def wrong_size(name, input_shape, num_classes, vocab_size=0, **kw):
        return nn.Sequential(nn.Flatten(), nn.Linear(100, num_classes))

    monkeypatch.setattr(startup, "build_model", wrong_size)
    with pytest.raises(UserError, match=r"'cnn' cannot take the inputs of .*\[1, 28, 28\]\): .*shapes cannot be multiplied"):
        startup.model_for_shard(_shard_cfg(digits6), info)
    # outputs that are not the shard's classes
    monkeypatch.setattr(startup, "build_model", lambda *a, **k: nn.Sequential(nn.Flatten(), nn.Linear(784, 3)))
    with pytest.raises(UserError, match=r"gives outputs of shape \[3\], not the shard's 10 classes"):
        startup.model_for_shard(_shard_cfg(digits6), info)


def test_model_for_shard_leaves_the_model_and_the_rng_alone(digits6):
    from fedcp_dist.engine import startup
    from fedcp_dist.data.shards import read_info

    info = read_info(str(digits6))
    torch.manual_seed(3)
    plain = build_model("cnn", info.input_shape, info.num_classes)
    after_plain = torch.get_rng_state()
    torch.manual_seed(3)
    checked = startup.model_for_shard(_shard_cfg(digits6), info)
    assert torch.equal(torch.get_rng_state(), after_plain)
    assert checked.training
    for (k, a), (_, b) in zip(plain.state_dict().items(), checked.state_dict().items()):
        assert torch.equal(a, b), k


def test_resnet18_on_one_channel_images_is_one_line(digits6, tmp_path):
    r = run_cmd([sys.executable, "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml", "model=resnet18",
                 f"data.path={digits6}", f"out_dir={tmp_path}", "rounds=1"], timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: config key 'model': 'resnet18' cannot take the inputs of")
    assert "[1, 28, 28]" in r.stderr and "3-channel" in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
