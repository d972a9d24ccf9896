"""FedCP (KDD'23) in parts: :mod:`.fedcp` composes the policy (:mod:`.cpn`), its input
(:mod:`.client_vector`), the loss terms (:mod:`.regularisers`), the per-round schedules
(:mod:`.schedules`), the policy's synchronisation (:mod:`.sync`) and the evaluation and probes
(:mod:`.probing`). Each part declares its own options; a new extension is a new part."""
from fedcp_dist.algorithms.fedcp.client_vector import CLIENT_VECTORS, ClientVector, client_stats
from fedcp_dist.algorithms.fedcp.fedcp import PARTS, FedCP, Heads
from fedcp_dist.algorithms.fedcp.cpn import (CPN, Policy, combine_group_logits, cpn_cost, group_pool, policy,
                                                policy_kl)
from fedcp_dist.algorithms.fedcp.schedules import annealed_tau, cpn_rate
from fedcp_dist.algorithms.fedcp.sync import POLICY_PREFIXES, PREV, PolicySync, interpolate, refresh_alpha

__all__ = ["CLIENT_VECTORS", "CPN", "ClientVector", "FedCP", "Heads", "PARTS", "POLICY_PREFIXES", "PREV", "Policy",
           "PolicySync", "annealed_tau", "client_stats", "combine_group_logits", "cpn_cost", "cpn_rate", "group_pool",
           "interpolate", "policy", "policy_kl", "refresh_alpha"]
