"""The config keys of what travels between ranks, declared apart from the code that reads them
(:mod:`fedcp_dist.comm.compress`, :mod:`fedcp_dist.comm.selection`); they apply to every method.
"""
from __future__ import annotations

from fedcp_dist.capabilities import ClientVectors, supports
from fedcp_dist.options import Option, one_of, within

COMPRESS_MODES = ("none", "topk")
COMPRESS_BITS = (32, 16, 8)


class CompressionOptions:
    """The config keys of upload compression (any method whose uploads are averaged)."""

    options = (
        Option("compress", "none", "uploads: none (dense float32) | topk (each tensor's delta to the received "
               "model, its largest entries only, quantised)", one_of(*COMPRESS_MODES)),
        Option("compress_ratio", 1.0, "compress=topk: fraction of each tensor's entries sent, in (0, 1]",
               within(0, 1, low_open=True)),
        Option("compress_bits", 32, "compress=topk: bits per sent value: 32 | 16 (half) | 8 (per-tensor scale and "
               "offset)", one_of(*COMPRESS_BITS)),
        Option("compress_error_feedback", False, "compress=topk: keep what was not sent in the client's state and add "
               "it to its next delta"),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.compress == "none":
            for key, default in (("compress_ratio", 1.0), ("compress_bits", 32), ("compress_error_feedback", False)):
                if getattr(cfg, key) != default:
                    return key, f"applies with compress=topk only (compress is none), got {getattr(cfg, key)!r}"
        elif not cfg.method_class.averages_uploads:
            return "compress", (f"{cfg.method} averages no uploads (its models travel in the peer exchange); "
                                f"use compress=none")
        return None


SELECTION_MODES = ("uniform", "feature_difference")
SELECTION_VECTORS = ("client", "features")


class SelectionOptions:
    """The config keys of client selection."""

    options = (
        Option("client_selection", "uniform", "cohorts with participation < 1: uniform | feature_difference (FedCP: "
               "p_i ∝ |D_i|·(1 − cos(v_i, mean v)))", one_of(*SELECTION_MODES)),
        Option("selection_min_prob", 0.01, "client_selection=feature_difference: floor of a client's draw "
               "probability before renormalising, in (0, 1]", within(0, 1, low_open=True)),
        Option("selection_vector", "client", "client_selection=feature_difference: the v_i compared: client (the "
               "method's client vector; FedCP: the head's column sums) | features (FedCP: the mean of the client's "
               "features h over its last local training)", one_of(*SELECTION_VECTORS)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.client_selection == "uniform" and cfg.selection_min_prob != 0.01:
            return "selection_min_prob", (f"applies with client_selection=feature_difference only (it is uniform), "
                                          f"got {cfg.selection_min_prob!r}")
        if cfg.client_selection == "uniform" and cfg.selection_vector != "client":
            return "selection_vector", (f"applies with client_selection=feature_difference only (it is uniform), "
                                        f"got {cfg.selection_vector!r}")
        if cfg.client_selection == "feature_difference" and not supports(cfg.method_class, ClientVectors):
            return "client_selection", f"feature_difference needs a method that keeps a client vector; {cfg.method} keeps none"
        return None
