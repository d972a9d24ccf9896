"""How much memory fused training takes, and how many clients one fused step trains at once.

:mod:`fedcp_dist.fused.slots` trains several clients' steps as one; this module holds the caps on how
many (per device kind), the device's free and total memory, and :class:`MemoryPlan`, a client's
bytes while it trains and after it finished. :mod:`fedcp_dist.fused.groups` sizes the groups with
them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

#: at most this many clients train at once on a CPU: beyond about 8 slots the slots' fully
#: connected weights and gradients (2 MiB + 2 MiB per client each for the CNN's 1024→512 layer
#: and FedCP's CPN) no longer fit in a typical last-level cache and the step rate per client falls
CPU_SLOTS = 8
#: at most this many clients train at once on a GPU (memory permitting): enough samples per step
#: (S·B) to fill the device for the small models here.
CUDA_SLOTS = 256
#: fraction of the available memory that fused training may plan to use
MEMORY_FRACTION = 0.5
#: an activation element is counted this many times per trained sample: the output kept for the
#: backward pass plus its gradient during the backward pass
ACTIVATION_COPIES = 2



def _host_memory(field: str, meminfo_key: str) -> int:
    """Host memory in bytes: psutil's ``virtual_memory().<field>`` when psutil is installed, else
    ``<meminfo_key>`` from /proc/meminfo, else 4 GiB (a conservative guess for systems without either)."""
    try:
        import psutil

        return int(getattr(psutil.virtual_memory(), field))
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(meminfo_key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``. CUDA: the driver's free memory plus what PyTorch's
    caching allocator holds unused; CPU: the host's available memory (:func:`_host_memory`)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return _host_memory("available", "MemAvailable")


def total_memory(device: torch.device) -> int:
    """Bytes of memory ``device`` has in all (a fact of the device kind, unlike the free memory):
    CUDA: the device's total memory; CPU: the host's total memory (:func:`_host_memory`)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return _host_memory("total", "MemTotal")


def activation_elements(run: Callable[[], object], modules: Sequence[nn.Module]) -> int:
    """Output elements of every leaf module of ``modules`` while ``run()`` does one forward pass.

    A module that states ``kept_activations`` (elements its fused form keeps per sample, e.g. an
    LSTM's every step) is counted by it, per sample of its output, instead of by its leaves."""
    total = 0

    def hook(_m, _inp, out):
        nonlocal total
        if isinstance(out, torch.Tensor):
            total += out.numel()

    def declared(m, _inp, out):
        nonlocal total
        total += int(m.kept_activations) * int(out.shape[0])

    counted = [m for mod in modules for m in mod.modules() if hasattr(m, "kept_activations")]
    inside = {id(c) for m in counted for c in m.modules()}
    handles = [m.register_forward_hook(declared) for m in counted]
    handles += [m.register_forward_hook(hook) for mod in modules for m in mod.modules()
                if not list(m.children()) and id(m) not in inside]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return total


@dataclass
class MemoryPlan:
    """Per-client memory of fused training, in bytes.

    * ``per_slot``: a training client's stacked parameters and their gradients (2 × 4 bytes per
      trained parameter, 4 per stacked constant) plus its activations:
      ``ACTIVATION_COPIES`` × 4 bytes × B × (activation elements per sample);
    * ``per_result``: a finished client's upload and new client state (4 bytes per element),
      held until the group returns.
    """

    per_slot: int
    per_result: int

    def slots(self, device: torch.device, clients: int, budget: Optional[int] = None) -> int:
        """Clients trained at once: memory permitting, at most the device's cap."""
        budget = int(MEMORY_FRACTION * available_memory(device)) if budget is None else budget
        cap = CUDA_SLOTS if device.type == "cuda" else CPU_SLOTS
        fit = budget // max(1, self.per_slot + self.per_result)
        return int(max(1, min(clients, cap, fit)))
