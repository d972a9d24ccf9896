"""Models, each split into ``features`` (f, to ``feature_dim`` = K) and ``head`` (g).

* ``cnn`` — the paper's 4-layer CNN, sized from the image shape (K = 512);
* ``resnet18`` — torchvision's ResNet-18 from scratch, 3-channel images (K = 512);
* ``fasttext`` — fastText on int64 token ids (B, max_len) with 0 as padding (K = ``fasttext_dim``,
  32; ``fasttext_mean`` and ``fasttext_feature`` choose the variant, see :mod:`.fasttext`);
* ``mlp`` — two ReLU layers on standardised table rows (B, F) (K = ``mlp_hidden``);
* ``lstm`` — a character LSTM on int64 ids (B, L) without padding, read at the last position
  (K = ``lstm_hidden``; LEAF's Shakespeare model by default, see :mod:`.lstm`).

BatchNorm layers are :mod:`.batchnorm`'s: a training batch of one value per channel (a client
holding one sample) is normalised by the running statistics instead of failing.

Also two helpers for methods that must treat BatchNorm (or dropout) with care:
:func:`mode_dependent` and :func:`forward_batch_stats`.
"""
from __future__ import annotations

import torch
from torch import nn

from fedcp_dist.models.batchnorm import one_value_batches
from fedcp_dist.models.cnn import CNN
from fedcp_dist.models.fasttext import EMBED_DIM, FEATURES as FASTTEXT_FEATURES, MEANS as FASTTEXT_MEANS, FastText
from fedcp_dist.models.lstm import EMBED_DIM as LSTM_EMBED, HIDDEN as LSTM_HIDDEN, LAYERS as LSTM_LAYERS, CharLSTM
from fedcp_dist.models.mlp import DEFAULT_HIDDEN, MLP
from fedcp_dist.models.resnet import ResNet18
from fedcp_dist.options import Component, Option, one_of, within

MODELS = ("cnn", "resnet18", "fasttext", "mlp", "lstm")
#: the widest layer a width key takes (a larger one would ask for memory no node has before a check could say so)
WIDEST = 65_536
#: the kind of shard (fedcp_dist.data.shards) each model reads
MODEL_KINDS = {"cnn": "image", "resnet18": "image", "fasttext": "text", "mlp": "table", "lstm": "text"}


#: the model keys of a config that build_model takes (besides the model's name)
MODEL_KEYS = ("mlp_hidden", "fasttext_dim", "fasttext_mean", "fasttext_feature", "lstm_embed", "lstm_hidden",
              "lstm_layers")


def model_options(cfg) -> dict:
    """The keyword arguments of :func:`build_model` that a config sets (its :data:`MODEL_KEYS`)."""
    return {key: getattr(cfg, key) for key in MODEL_KEYS}


def build_model(name: str, input_shape, num_classes: int, vocab_size: int = 0,
                mlp_hidden: int = DEFAULT_HIDDEN, fasttext_dim: int = EMBED_DIM,
                fasttext_mean: str = "padded", fasttext_feature: str = "linear", lstm_embed: int = LSTM_EMBED,
                lstm_hidden: int = LSTM_HIDDEN, lstm_layers: int = LSTM_LAYERS) -> nn.Module:
    """Build a model with ``.features``, ``.head`` and ``.feature_dim``.

    ``input_shape`` is one sample's shape: [C, H, W] for the image models, [max_len] for fasttext,
    which also needs the ``vocab_size`` (ids 0 .. vocab_size - 1, 0 the padding) and takes
    ``fasttext_dim``, ``fasttext_mean``, ``fasttext_feature``, [F] for mlp (``mlp_hidden`` wide),
    [L] for lstm (the ``vocab_size`` too; ``lstm_embed``, ``lstm_hidden``, ``lstm_layers``).
    Parameters are drawn from torch's global RNG: seed it first for identical models on every rank.
    Its BatchNorms train on a batch of one value per channel (:mod:`.batchnorm`).
    """
    shape = tuple(int(s) for s in input_shape)
    num_classes = int(num_classes)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if num_classes < 1:
        raise ValueError(f"model {name!r} needs at least one class, got num_classes={num_classes}")
    fasttext = {"dim": int(fasttext_dim), "mean": fasttext_mean, "feature": fasttext_feature}
    lstm = {"embed": int(lstm_embed), "hidden": int(lstm_hidden), "layers": int(lstm_layers)}
    model = one_value_batches(_build(name, shape, num_classes, vocab_size, mlp_hidden, fasttext, lstm))
    model.input_kind, model.input_shape = MODEL_KINDS[name], shape  # for methods that read the data's shape
    return model


def _build(name: str, shape: tuple, num_classes: int, vocab_size: int, mlp_hidden: int,
           fasttext: dict, lstm: dict) -> nn.Module:
    if name in ("cnn", "resnet18"):
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"model {name!r} takes images [C, H, W], got input shape {list(shape)}")
        if name == "cnn":
            return CNN(shape, num_classes)
        if shape[0] != 3:
            raise ValueError(f"model 'resnet18' takes 3-channel images, got input shape {list(shape)}")
        return ResNet18(num_classes)
    if name == "mlp":
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"model 'mlp' takes feature rows [features], got input shape {list(shape)}")
        if int(mlp_hidden) < 1:
            raise ValueError(f"model 'mlp' needs mlp_hidden >= 1, got {mlp_hidden}")
        return MLP(shape[0], num_classes, int(mlp_hidden))
    if name == "lstm":
        return _lstm(shape, num_classes, vocab_size, **lstm)
    # fasttext
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"model 'fasttext' takes token ids [max_len], got input shape {list(shape)}")
    if int(vocab_size) < 1:
        raise ValueError(f"model 'fasttext' needs the vocabulary size (> 0, id 0 is padding), got vocab_size={vocab_size}")
    if fasttext["dim"] < 1:
        raise ValueError(f"model 'fasttext' needs fasttext_dim >= 1, got {fasttext['dim']}")
    return FastText(int(vocab_size), num_classes, **fasttext)


def _lstm(shape: tuple, num_classes: int, vocab_size: int, embed: int, hidden: int, layers: int) -> nn.Module:
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"model 'lstm' takes character ids [sequence length], got input shape {list(shape)}")
    if int(vocab_size) < 1:
        raise ValueError(f"model 'lstm' needs the vocabulary size (> 0), got vocab_size={vocab_size}")
    for key, value in (("lstm_embed", embed), ("lstm_hidden", hidden), ("lstm_layers", layers)):
        if value < 1:
            raise ValueError(f"model 'lstm' needs {key} >= 1, got {value}")
    return CharLSTM(int(vocab_size), shape[0], num_classes, embed, hidden, layers)


def mode_dependent(module: nn.Module) -> bool:
    """True when ``module`` computes differently in training mode: BatchNorm (batch statistics,
    running-statistics updates) or dropout."""
    return any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)) for m in module.modules())


def _batchnorms(module: nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@torch.no_grad()
def forward_batch_stats(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` with every BatchNorm normalising by the batch's own statistics (as in training
    mode), with no gradient and no side effect: the BatchNorms' buffers (running statistics,
    counters) and modes are left as they were; other layers run in the module's current mode.
    A module without BatchNorm is simply called (bit-identical to ``module(x)``)."""
    bns = _batchnorms(module)
    if not bns:
        return module(x)
    saved = [(m.training, [b.clone() for b in m.buffers()]) for m in bns]
    try:
        for m in bns:
            m.train()
        return module(x)
    finally:
        for m, (training, buffers) in zip(bns, saved):
            for b, old in zip(m.buffers(), buffers):
                b.copy_(old)
            m.train(training)


class ModelChoice(Component):
    """The model and its size."""

    options = (
        Option("model", "cnn", "model: cnn (the paper's 4-layer CNN, sized from the shard's input shape) | resnet18 | "
               "fasttext (text shards) | mlp (table shards) | lstm (character sequences without padding, e.g. "
               "LEAF's Shakespeare)", one_of(*MODELS)),
        Option("mlp_hidden", DEFAULT_HIDDEN, "mlp: width H of its two hidden layers (the feature dimension K)",
               within(1, WIDEST)),
        Option("fasttext_dim", EMBED_DIM, "fasttext: embedding and feature width K (32, as the FedCP authors' AG News "
               "runs)", within(1, WIDEST)),
        Option("fasttext_mean", "padded", "fasttext: padded averages the embeddings over all max_len positions, padding "
               "included (the authors' model); tokens over the real tokens only (this project's first variant)",
               one_of(*FASTTEXT_MEANS)),
        Option("fasttext_feature", "linear", "fasttext: where the head starts: linear = after Linear(K, K) (the authors' "
               "FedCP repository); log_softmax = after a log-softmax on it (PFLlib's fastText of 2021-2024 under its "
               "head split)", one_of(*FASTTEXT_FEATURES)),
        Option("lstm_embed", LSTM_EMBED, "lstm: width of the character embedding (8, as LEAF's and the FedAvg paper's "
               "Shakespeare model)", within(1, WIDEST)),
        Option("lstm_hidden", LSTM_HIDDEN, "lstm: units per LSTM layer, the feature dimension K (256, as LEAF's and the "
               "FedAvg paper's Shakespeare model)", within(1, WIDEST)),
        Option("lstm_layers", LSTM_LAYERS, "lstm: stacked LSTM layers (2, as LEAF's and the FedAvg paper's Shakespeare "
               "model)", within(1, 64)),
    )

    @classmethod
    def inert_keys(cls, cfg) -> dict:
        """A key named after a model (``mlp_hidden``, ``fasttext_dim``) acts on that model only."""
        return {o.name: f"acts on model={m} only" for o in cls.options for m in MODELS
                if o.name.startswith(m + "_") and cfg.model != m}
