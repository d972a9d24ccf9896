"""Grad-CAM (Selvaraju et al., 2017) of FedCP's two heads, with a forward hook.

For a class c and a convolutional layer with activations A (K maps of u×v), Grad-CAM weighs each
map by the mean gradient of the class score over it and keeps the positive part:

    α_k = mean_ij ∂y_c/∂A_k[i, j],   L = ReLU(Σ_k α_k · A_k),

then scales L to [0, 1] (divided by its maximum; an all-zero map stays zero) and, for display,
bilinearly up-samples it to the input's size. The activations are the layer's output as the network
uses it: when an in-place ReLU follows the convolution (the 4-layer CNN), that is the rectified map.

Why hooks and not the ``grad-cam`` package: the computation is the dozen lines below and is tested
against a hand computation; the score explained here is a FedCP head's logit, a function of the
client's state rather than a module's output, which the package would need wrapped; and the
package brings opencv-python and ttach with it.

FedCP: the personalized model's logits are g(s ⊙ h; W_i^hd) + g(r ⊙ h; W^hd); "only the global
head active" explains the second term's logit of the class, "only the personal head active" the
first's. Both go through the received extractor, whose last ``nn.Conv2d`` is hooked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.errors import UserError

HEADS = ("global", "personal")


def grad_cam(forward: Callable[[torch.Tensor], torch.Tensor], layer: nn.Module, x: torch.Tensor,
             target: torch.Tensor, size: Optional[tuple] = None) -> torch.Tensor:
    """Grad-CAM maps (B, u, v) — or (B, *size) up-sampled — in [0, 1] for the class ``target[b]`` of
    each input, ``forward(x)`` giving (B, classes) scores computed through ``layer``.

    The scores of different inputs must not depend on each other (evaluation mode), since one
    backward pass serves the whole batch.
    """
    captured = []

    def hook(module, inputs, output):
        captured.append(output)

    handle = layer.register_forward_hook(hook)
    try:
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)  # so the graph reaches the layer even if it is frozen
            scores = forward(x)
            if not captured:
                raise UserError("Grad-CAM: the chosen layer is not used by the forward pass")
            acts = captured[-1]
            chosen = scores.gather(1, target.view(-1, 1).to(scores.device)).sum()
            (grads,) = torch.autograd.grad(chosen, acts)
    finally:
        handle.remove()
    weights = grads.mean(dim=(2, 3), keepdim=True)  # α_k per input
    cam = F.relu((weights * acts.detach()).sum(1))  # (B, u, v)
    peak = cam.flatten(1).amax(1).view(-1, 1, 1)
    cam = torch.where(peak > 0, cam / peak.clamp_min(1e-30), torch.zeros_like(cam))
    if size is not None:
        cam = F.interpolate(cam[:, None], size=tuple(size), mode="bilinear", align_corners=False)[:, 0]
        cam = cam.clamp(0.0, 1.0)
    return cam.detach()


def last_conv(module: nn.Module) -> nn.Module:
    """The last ``nn.Conv2d`` of ``module`` in registration order (the 4-layer CNN's second
    convolution; ResNet-18's ``layer4[1].conv2``)."""
    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise UserError("Grad-CAM needs a convolutional extractor; this model has no Conv2d layer")
    return convs[-1]


def find_layer(module: nn.Module, name: Optional[str]) -> nn.Module:
    """The sub-module called ``name`` (as ``named_modules`` spells it), or the last Conv2d."""
    if not name:
        return last_conv(module)
    named = dict(module.named_modules())
    if name not in named:
        choices = ", ".join(n for n in named if n)
        raise UserError(f"--layer {name!r} is not a module of the extractor; its modules: {choices}")
    return named[name]


@dataclass
class HeadMaps:
    """Grad-CAM of one client's samples under each head."""

    client: int
    images: torch.Tensor  # (n, C, H, W) pixels in [0, 1]
    labels: torch.Tensor  # (n,) the explained class (the true label)
    pred: dict  # head name (and "both") -> (n,) predicted classes
    cams: dict  # head name -> (n, H, W) in [0, 1]


def fedcp_head_maps(state, cid: int, data, samples: int, layer_name: Optional[str] = None) -> HeadMaps:
    """Grad-CAM of client ``cid``'s first ``samples`` test images under FedCP's global head alone and
    its personal head alone (the class explained: the true label), from the run ``state``."""
    from fedcp_dist.algorithms.base import Context

    algo = state.algo
    if not hasattr(algo, "head_outputs") or not hasattr(algo, "fe_g"):
        raise UserError(f"Grad-CAM compares FedCP's global and personal heads; {state.run_dir} ran "
                        f"{state.cfg.method}")
    if data.n_test == 0:
        raise UserError(f"client {cid} has no test samples to explain")
    n = min(samples, data.n_test)
    x, y = data.test_batch(0, n)
    client_state = state.use_client(cid)
    ctx = Context(state.rounds_done, cid, torch.Generator(device=state.device).manual_seed(0))
    layer = find_layer(algo.fe_g, layer_name)
    cams = {}
    for i, head in enumerate(("personal", "global")):
        cams[head] = grad_cam(lambda inp, i=i: algo.head_outputs(client_state, inp, ctx)[i], layer, x, y,
                              size=tuple(x.shape[-2:])).cpu()
    with torch.no_grad():
        personal, global_ = algo.head_outputs(client_state, x, ctx)
    pred = {"personal": personal.argmax(1).cpu(), "global": global_.argmax(1).cpu(),
            "both": (personal + global_).argmax(1).cpu()}
    images = (data.test_x[:n].float() / 255.0).cpu()
    return HeadMaps(cid, images, y.cpu(), pred, cams)
