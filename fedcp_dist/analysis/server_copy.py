"""The server's differentiable copy of a client's local training (:class:`ServerCopy`) and the
gradient it reads from an upload (:func:`observed_gradient`): what the DLG/iDLG attack of
:mod:`fedcp_dist.analysis.dlg` matches, method by method (its module docstring says what each
method uploads and what the server knows of it)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedcp_dist.analysis.gradient_match import soft_cross_entropy
from fedcp_dist.errors import UserError

#: the methods the server's copy knows
METHODS = ("fedavg", "fedper", "fedcp")


# ----------------------------------------------------------------------------- the server's copy of a method


class ServerCopy:
    """The server's differentiable copy of one client's local training, as far as it can know it.

    ``pseudo_gradient(x, y)`` is what the server would read from the upload if the client had
    trained on (x, y): (sent − uploaded)/(η·S) for each matched key, to first order in η (one step on
    the whole attacked sample set).
    """

    def __init__(self, method: str, model: torch.nn.Module, sent: dict, private: Optional[dict], lr_steps: float,
                 mean, std, tau: float = 1.0):
        if method not in METHODS:
            raise UserError(f"DLG attacks {', '.join(METHODS)}; this run's method is {method}")
        self.method = method
        self.model = model
        self.lr_steps = float(lr_steps)
        self.tau = float(tau)
        dev = next(iter(sent.values())).device
        channels = len(mean)
        self.mean = torch.as_tensor(np.asarray(mean, np.float32)).view(1, channels, 1, 1).to(dev)
        self.std = torch.as_tensor(np.asarray(std, np.float32)).view(1, channels, 1, 1).to(dev)
        feat = {n for n, _ in model.features.named_parameters()}
        head = {n for n, _ in model.head.named_parameters()}
        self.fe = {n: sent[f"features.{n}"] for n in feat}
        self.fe_buffers = {n: b.clone() for n, b in model.features.named_buffers()}
        for n in self.fe_buffers:
            if f"features.{n}" in sent:
                self.fe_buffers[n] = sent[f"features.{n}"].clone()
        self.head_sent = {n: sent[f"head.{n}"] for n in head}
        # the head the client trained from: its own (oracle) or the server's stand-in
        if method == "fedavg":
            self.head = dict(self.head_sent)
        else:
            own = private if private is not None else {f"head.{n}": t for n, t in self.head_sent.items()}
            self.head = {n: own[f"head.{n}"] for n in head}
        if method == "fedcp":
            self.cpn = {k[len("cpn."):]: v for k, v in sent.items() if k.startswith("cpn.")}
            expected = {"net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias"}
            if set(self.cpn) != expected:
                raise UserError("DLG models FedCP's CPN as the paper's Linear → LayerNorm → ReLU; this run's CPN "
                                f"has the parameters {sorted(self.cpn)}")
            v = private["v"] if private is not None else self.head["weight"].sum(0)
            self.v = F.normalize(v.detach(), dim=0)

    # -- forward passes ----------------------------------------------------------
    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def features(self, fe: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model.features, ({**fe, **{k: b.clone() for k, b in self.fe_buffers.items()}},), (x,))

    def policy(self, cpn: dict, h: torch.Tensor):
        """FedCP's CPN: (s, r) = softmax over the pair of ReLU(LayerNorm(Linear(v̂ ⊙ h))), viewed (B, 2, K)."""
        k = h.shape[1]
        z = F.linear(self.v * h, cpn["net.0.weight"], cpn["net.0.bias"])
        z = F.relu(F.layer_norm(z, (2 * k,), cpn["net.1.weight"], cpn["net.1.bias"]))
        p = torch.softmax(z.view(-1, 2, k) / self.tau, dim=1)
        return p[:, 0], p[:, 1]

    def logits(self, params: dict, x_norm: torch.Tensor) -> torch.Tensor:
        h = self.features(params["fe"], x_norm)
        if self.method != "fedcp":
            return functional_call(self.model.head, (params["head"],), (h,))
        s, r = self.policy(params["cpn"], h)
        return (functional_call(self.model.head, (params["head"],), (s * h,))
                + functional_call(self.model.head, (self.head_sent,), (r * h,)))

    def start(self, requires_grad: bool) -> dict:
        """The parameters the client starts local training from (as the server knows them)."""
        def leaf(d):
            return {k: v.detach().clone().requires_grad_(requires_grad) for k, v in d.items()}

        params = {"fe": leaf(self.fe), "head": leaf(self.head)}
        if self.method == "fedcp":
            params["cpn"] = leaf(self.cpn)
        return params

    @torch.no_grad()
    def predict(self, x_norm: torch.Tensor) -> torch.Tensor:
        """Evaluation-mode logits (for the check against the method's own ``predict``)."""
        was = self.model.features.training
        self.model.features.eval()
        try:
            return self.logits(self.start(False), x_norm)
        finally:
            self.model.features.train(was)

    # -- what the server reads -----------------------------------------------------
    def matched_keys(self) -> list:
        keys = [f"features.{n}" for n in self.fe]
        if self.method in ("fedavg", "fedcp"):
            keys += [f"head.{n}" for n in self.head]
        if self.method == "fedcp":
            keys += [f"cpn.{n}" for n in self.cpn]
        return sorted(keys)

    def pseudo_gradient(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        self.model.features.train()  # the client trains in training mode (BatchNorm: batch statistics)
        params = self.start(True)
        loss = soft_cross_entropy(self.logits(params, self.normalise(x)), y)
        groups = [("features.", params["fe"]), ("head.", params["head"])]
        if self.method == "fedcp":
            groups.append(("cpn.", params["cpn"]))
        if self.method == "fedper":
            groups = groups[:1]
        flat = [(prefix + n, t) for prefix, d in groups for n, t in d.items()]
        grads = torch.autograd.grad(loss, [t for _, t in flat], create_graph=True)
        out = dict(zip([k for k, _ in flat], grads))
        if self.method == "fedcp":
            # the mixed head: (W^hd − (W^hd + W_i − η·S·∇)/2)/(η·S) = (W^hd − W_i)/(2η·S) + ∇/2
            for n in self.head:
                offset = (self.head_sent[n] - self.head[n]).detach() / (2.0 * self.lr_steps)
                out[f"head.{n}"] = offset + 0.5 * out[f"head.{n}"]
        return out


def observed_gradient(sent: dict, upload: dict, keys: list, lr_steps: float) -> dict:
    """(sent − uploaded)/(η·S) of each key, the difference taken in float64."""
    missing = [k for k in keys if k not in upload]
    if missing:
        raise UserError(f"the method's upload has no '{missing[0]}'; the server's copy of it expects "
                        f"{', '.join(keys)}")
    return {k: ((sent[k].double() - upload[k].double()) / lr_steps).to(sent[k].dtype) for k in keys}
