"""Federated methods, one file each; ``make_algorithm`` picks one by name."""
from __future__ import annotations

from fedcp_dist.algorithms.base import Algorithm
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.algorithms.fedcp import FedCP

ALGORITHMS = {cls.name: cls for cls in (FedCP, FedAvg)}


def make_algorithm(name: str, cfg, model, device) -> Algorithm:
    return ALGORITHMS[name](cfg, model, device)
