"""The modules FedCP's variants add to the policy, registered by name.

A variant that adds a module (the client vector's projection ``vproj``, the group-level policy
``cpng``, the learned client embedding ``emb``) registers a :class:`PolicyModule` from the file of
its part; :class:`~fedcp_dist.algorithms.fedcp.FedCP` then does the rest alike for every module:
builds it, registers it among the trained (and, for a shared module, the received) modules under
the prefix ``<name>.``, puts its values in the global state or the client state, in the phase's
start values and in the upload, lets the policy's synchronisation and rate treat a shared module
as part of the policy, and loads it for evaluation and the probes. The part says where the module
acts: its own code runs it (``step.run(name, x)``), or the module's ``logits`` adds its share to
the policy's pair logits (:meth:`~fedcp_dist.algorithms.fedcp.cpn.Policy.logits`).

The random draws follow the recorded results' order: the paper's CPN, then every shared module in
``draw`` order, then a Table 10 CPN design that replaces the paper's, then every client module in
``draw`` order. A new module takes the next ``draw`` number, so that every run without it draws
what it drew before (and a module that is off draws nothing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn


@dataclass(frozen=True)
class PolicyModule:
    """A module of the policy that a variant adds.

    * ``name`` — its values are ``<name>.<parameter>``; ``step.run(name, x)`` applies it;
    * ``draw`` — its place in the order of the random draws (see the module's docstring);
    * ``shared`` — True: global, trained by the clients and averaged with the CPN, part of the policy
      (its synchronisation, its rate, the received copy that evaluation and the distillation's
      teacher apply); False: each client's own, kept in its state, never uploaded;
    * ``build(algo)`` — the module for this run (the FedCP method, its parts built), or None: off;
    * ``logits(policy, c, logits, apply)`` — optional: the pair logits with the module's share added
      (``policy``: FedCP's :class:`~fedcp_dist.algorithms.fedcp.cpn.Policy`; ``apply(x)`` runs the
      module, trained, or received and without gradient for the distillation's teacher);
    * ``note(policy, module)`` — optional: what the run's start line says of it.
    """

    name: str
    draw: int
    shared: bool
    build: Callable[[Any], Optional[nn.Module]]
    logits: Optional[Callable[..., Any]] = None
    note: Optional[Callable[[Any, nn.Module], str]] = None

    @property
    def prefix(self) -> str:
        return f"{self.name}."


_REGISTERED: Dict[str, PolicyModule] = {}


def register(module: PolicyModule) -> PolicyModule:
    """Add a module of the policy (from its part's file); its name and its ``draw`` are its own."""
    taken = {m.draw: m.name for m in _REGISTERED.values() if m.name != module.name}
    if module.draw in taken:
        raise ValueError(f"policy module {module.name!r} takes draw {module.draw} of {taken[module.draw]!r}")
    if module.name in ("features", "head", "cpn"):
        raise ValueError(f"policy module name {module.name!r} is the model's or the CPN's")
    _REGISTERED[module.name] = module
    return module


def registered(shared: Optional[bool] = None) -> List[PolicyModule]:
    """The registered modules (shared or the clients' own ones only, else all), in ``draw`` order."""
    return sorted((m for m in _REGISTERED.values() if shared is None or m.shared == shared), key=lambda m: m.draw)


def policy_prefixes() -> Tuple[str, ...]:
    """The value prefixes of the policy's networks: the CPN's and every shared module's."""
    return ("cpn.", *(m.prefix for m in registered(shared=True)))
