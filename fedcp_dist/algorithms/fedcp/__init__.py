"""FedCP (KDD'23) in parts: :mod:`.fedcp` composes the policy (:mod:`.cpn`), its input
(:mod:`.client_vector`), the loss terms (:mod:`.regularisers`), the per-round schedules
(:mod:`.schedules`), the policy's synchronisation (:mod:`.sync`) and the evaluation and probes
(:mod:`.probing`). Each part declares its own options; a new extension is a new part, and a module
it adds to the policy is registered by name (:mod:`.modules`)."""
from fedcp_dist.algorithms.fedcp.client_vector import CLIENT_VECTORS, ClientVector, client_stats
from fedcp_dist.algorithms.fedcp.fedcp import PARTS, FedCP, Heads
from fedcp_dist.algorithms.fedcp.cpn import (CPN, Policy, combine_group_logits, cpn_cost, group_pool, policy,
                                                policy_kl)
from fedcp_dist.algorithms.fedcp.schedules import annealed_tau, cpn_rate
from fedcp_dist.algorithms.fedcp.modules import PolicyModule, policy_prefixes, register, registered
from fedcp_dist.algorithms.fedcp.sync import PREV, PolicySync, interpolate, refresh_alpha

__all__ = ["CLIENT_VECTORS", "CPN", "ClientVector", "FedCP", "Heads", "PARTS", "PREV", "Policy", "PolicyModule",
           "PolicySync", "annealed_tau", "client_stats", "combine_group_logits", "cpn_cost", "cpn_rate", "group_pool",
           "interpolate", "policy", "policy_kl", "policy_prefixes", "refresh_alpha", "register", "registered"]
