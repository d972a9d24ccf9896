"""Compressed uploads: what a real client would send instead of its dense model, for any method.

A participant uploads, per aggregated tensor, its delta Δ = θ_i − θ_global (θ_i the tensor the
method uploads, θ_global the one it received). With ``compress=topk``:

1. with error feedback, the residual e_i the client did not send last time is added: Δ' = Δ + e_i;
2. the k = ⌈ρ_c · n⌉ entries of largest magnitude are kept (n the tensor's entries, at least one;
   ties by the lower index);
3. the kept values are quantised: 32 bits as they are, 16 bits as IEEE half precision, 8 bits as
   codes q = round((x − lo) / s) ∈ [0, 255] with the per-tensor offset lo = min and scale
   s = (max − lo) / 255 of the kept values (decoded lo + q·s; s = 0 when they are all equal);
4. the server decodes Δ̂ (zeros where nothing was sent); with error feedback the client keeps
   e_i ← Δ' − Δ̂ in its own state (checkpointed with it).

The server's new model is θ_global + Σ n_i·Δ̂_i / Σ n_i. The simulator's all-reduce stays dense
(it is the transport between ranks): compression changes what the numbers are, and the
accounting of what a deployment would send.

Bytes a client sends per tensor: the values (k · bits / 8), for 8 bits the scale and offset (two
float32, 8 bytes), and the positions unless every entry is sent (k = n): the cheaper of k indices
of the narrowest unsigned integer that holds n − 1 (1, 2 or 4 bytes) and a bitmap of ⌈n / 8⌉
bytes. The dense upload is 4 · n bytes. The download (the server's model to each participant)
is sent dense: 4 · n bytes per tensor and participant.
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import torch

from fedcp_dist.comm.privacy import clip_factor, total_norm
from fedcp_dist.state.client_store import BN_STAT_SUFFIXES


State = Dict[str, torch.Tensor]


def kept_count(n: int, ratio: float) -> int:
    """k = ⌈ratio · n⌉ entries of an n-entry tensor, at least one (none of an empty tensor)."""
    if n <= 0:
        return 0
    return max(1, min(n, math.ceil(ratio * n - 1e-9)))


def index_width(n: int) -> int:
    """Bytes of the narrowest unsigned integer that holds every position 0 … n − 1."""
    return 1 if n <= 1 << 8 else 2 if n <= 1 << 16 else 4


def index_bytes(n: int, k: int) -> int:
    """Bytes that say which k of n entries are sent: none when all are, else the cheaper of k
    indices and an n-bit bitmap."""
    if k >= n:
        return 0
    return min(k * index_width(n), (n + 7) // 8)


def value_bytes(k: int, bits: int) -> int:
    """Bytes of k quantised values; 8 bits adds the per-tensor scale and offset (two float32)."""
    if k == 0:
        return 0
    return k * bits // 8 + (8 if bits == 8 else 0)


def tensor_bytes(n: int, ratio: float, bits: int) -> int:
    """What one client sends for one n-entry tensor."""
    k = kept_count(n, ratio)
    return value_bytes(k, bits) + index_bytes(n, k)


def quantise(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The values as the server decodes them after ``bits``-bit quantisation (float32)."""
    values = values.to(torch.float32)
    if bits == 32 or values.numel() == 0:
        return values.clone()
    if bits == 16:
        return values.to(torch.float16).to(torch.float32)
    lo, hi = values.min(), values.max()
    scale = (hi - lo) / 255.0
    if float(scale) == 0.0:
        return torch.full_like(values, float(lo))
    codes = torch.round((values - lo) / scale).clamp_(0, 255)
    return lo + codes * scale


def compress_tensor(delta: torch.Tensor, ratio: float, bits: int) -> torch.Tensor:
    """Δ̂: the decoded top-k, quantised delta, dense and shaped like ``delta`` (float32)."""
    flat = delta.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    k = kept_count(n, ratio)
    out = torch.zeros_like(flat)
    if k == 0:
        return out.view(delta.shape)
    if k < n:
        idx = torch.sort(flat.abs(), descending=True, stable=True).indices[:k]
    else:
        idx = torch.arange(n, device=flat.device)
    out[idx] = quantise(flat[idx], bits)
    return out.view(delta.shape)


class Compressor:
    """The run's upload compression over the aggregated tensors ``shapes`` ({name: shape})."""

    def __init__(self, mode: str, ratio: float, bits: int, error_feedback: bool, shapes: Mapping[str, torch.Size]):
        self.mode, self.ratio, self.bits, self.error_feedback = mode, float(ratio), int(bits), bool(error_feedback)
        self.names = list(shapes)
        self.sizes = {k: int(torch.Size(s).numel()) for k, s in shapes.items()}
        #: bytes of one client's dense float32 upload (and of one participant's download)
        self.dense_bytes = 4 * sum(self.sizes.values())
        #: bytes one client sends (the dense upload when compression is off)
        self.client_bytes = self.sent_bytes(self.names)

    def sent_bytes(self, names) -> int:
        """Bytes one client sends for the tensors ``names`` (dense float32 when compression is off)."""
        if not self.enabled:
            return 4 * sum(self.sizes[k] for k in names)
        return sum(tensor_bytes(self.sizes[k], self.ratio, self.bits) for k in names)

    @classmethod
    def from_config(cls, cfg, shapes) -> "Compressor":
        return cls(cfg.compress, cfg.compress_ratio, cfg.compress_bits, cfg.compress_error_feedback, shapes)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def compress(self, upload: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor],
                 residual: Optional[State] = None) -> Tuple[State, Optional[State]]:
        """(Δ̂ per tensor, the new residual or None without error feedback) of one client's upload;
        a tensor it does not send (absent from ``upload``) keeps its residual for a later round."""
        decoded, new_residual = {}, {} if self.error_feedback else None
        for k in self.names:
            if k not in upload:
                if self.error_feedback and residual is not None and k in residual:
                    new_residual[k] = residual[k]
                continue
            delta = upload[k].detach().to(torch.float32) - global_state[k].to(torch.float32)
            if self.error_feedback and residual is not None and k in residual:
                delta = delta + residual[k]
            decoded[k] = compress_tensor(delta, self.ratio, self.bits)
            if self.error_feedback:
                new_residual[k] = delta - decoded[k]
        return decoded, new_residual

    def compress_clipped(self, upload: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor], keys,
                         clip: float, residual: Optional[State] = None) -> Tuple[State, float, Optional[State], float]:
        """``dp: central``'s compressed upload (:mod:`fedcp_dist.comm.privacy`) over the round's tensors ``keys``:

        1. Δ' = Δ (+ e_i with error feedback) of every tensor, clipped to L2 norm C as one vector: v;
        2. v compressed tensor by tensor (top-k, quantised) into Δ̂;
        3. quantisation can raise the norm above C (8 bits round each kept value to a grid between
           their min and max, 16 bits to the nearest half), so Δ̂ is sent with weight w = min(1, C/‖Δ̂‖);
        4. error feedback keeps e_i ← v − w·Δ̂, what the clipped vector did not deliver; what
           clipping cut off is dropped, as without compression (so ‖e_i‖ ≤ 2C, and ratio 1 at 32
           bits is plain clipping). The residual is the client's own state; it reaches the server
           only through later uploads, each clipped again.

        Returns (Δ̂, w, the new residual or None, ‖Δ'‖)."""
        delta = {}
        for k in keys:
            d = upload[k].detach().to(torch.float32) - global_state[k].to(torch.float32)
            if self.error_feedback and residual is not None and k in residual:
                d = d + residual[k]
            delta[k] = d
        norm = total_norm(delta.values())
        scale = clip_factor(norm, clip)
        clipped = {k: d * scale for k, d in delta.items()} if scale < 1 else delta
        decoded = {k: compress_tensor(v, self.ratio, self.bits) for k, v in clipped.items()}
        weight = clip_factor(total_norm(decoded.values()), clip)
        new_residual = None
        if self.error_feedback:
            new_residual = {k: v for k, v in (residual or {}).items() if k not in clipped}  # tensors not sent now
            new_residual.update({k: clipped[k] - weight * decoded[k] for k in clipped})
        return decoded, weight, new_residual, norm

    def round_bytes(self, senders: Mapping[str, int], participants: int) -> dict:
        """The round's accounting: ``senders[k]`` clients sent tensor k (compressed if enabled; the
        dense bytes are those of the same uploads as float32), ``participants`` received the whole
        model."""
        return {"uplink_bytes": sum(n * self.sent_bytes([k]) for k, n in senders.items()),
                "uplink_bytes_dense": sum(n * 4 * self.sizes[k] for k, n in senders.items()),
                "downlink_bytes": participants * self.dense_bytes,
                "downlink_bytes_dense": participants * self.dense_bytes}


BYTE_KEYS = ("uplink_bytes", "uplink_bytes_dense", "downlink_bytes", "downlink_bytes_dense")


SAVED_KEYS = ("uplink_bytes_sent", "uplink_bytes_saved")


def byte_totals(records) -> dict:
    """The run's totals of the per-round byte counts, for the kinds its rounds have (none for a
    method that averages no uploads); with skipped uploads also the fraction saved."""
    out = {k: int(sum(r.get(k, 0) for r in records)) for k in (*BYTE_KEYS, *SAVED_KEYS)
           if records and all(k in r for r in records)}  # a count that began mid-run has no total
    if "uplink_bytes_saved" in out:
        total = out.get("uplink_bytes_sent", 0) + out["uplink_bytes_saved"]
        out["uplink_saved_fraction"] = out["uplink_bytes_saved"] / total if total else 0.0
    return out


def uplink_record(compressor, agg, uploaders: int, participants: int) -> dict:
    """A round's byte counts (:meth:`Compressor.round_bytes`), every run whose uploads are averaged:
    each tensor of the round's buffer counted once per client that sent it (``uploaders``, or for a
    tensor of an aggregation group the clients that sent that group). Where a method has such groups
    (parts of the upload some clients, or all of a round's, do not send) also the dense float32
    bytes sent and saved. Nothing for a method that averages no uploads (its models travel in the
    peer exchange)."""
    if not agg.names:
        return {}
    group_senders = {g: int(n) for g, (_, n) in agg.group_totals.items()}
    senders = {k: group_senders.get(agg.group_of[k], 0) if k in agg.group_of else uploaders for k in agg.sent}
    out = compressor.round_bytes(senders, participants)
    if agg.groups:
        skipped = sum((uploaders - int(n)) * agg.group_numel(g) for g, (_, n) in agg.group_totals.items())
        out.update(uplink_bytes_sent=4 * (uploaders * agg.num_params - skipped), uplink_bytes_saved=4 * skipped)
    return out


def upload_parts(algo, global_state: Mapping[str, torch.Tensor], aggregate_bn_stats: bool = False) -> Dict[str, int]:
    """Entries one participant uploads, per part of the model: the first component of each
    averaged key (``features``, ``head``, ``cpn``, ...), in upload order. The keys are those the
    engine averages: the method's upload keys less the BatchNorm running statistics, which stay with
    each client unless ``aggregate_bn_stats``. The dense upload is 4 bytes an entry."""
    out: Dict[str, int] = {}
    for key in algo.upload_keys(global_state):
        if not aggregate_bn_stats and key.endswith(BN_STAT_SUFFIXES):
            continue
        part = key.split(".", 1)[0]
        out[part] = out.get(part, 0) + int(global_state[key].numel())
    return out


def skipped_part_saving(share: float, sent_rounds: int, rounds: int) -> float:
    """The fraction of the dense uplink saved when a part that is ``share`` of every upload travels
    in only ``sent_rounds`` of ``rounds`` rounds (every participant, every round otherwise):
    share · (1 − sent_rounds / rounds)."""
    if rounds <= 0 or not 0 <= sent_rounds <= rounds:
        raise ValueError(f"sent_rounds must lie in 0..rounds, got {sent_rounds} of {rounds}")
    return share * (1.0 - sent_rounds / rounds)
