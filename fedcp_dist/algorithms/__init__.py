"""Federated methods, one file each; ``make_algorithm`` picks one by name."""
from __future__ import annotations

from fedcp_dist.algorithms.base import Algorithm
from fedcp_dist.algorithms.ditto import Ditto
from fedcp_dist.algorithms.fedamp import FedAMP
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.algorithms.fedcp import FedCP
from fedcp_dist.algorithms.fedfomo import FedFomo
from fedcp_dist.algorithms.fedper import FedPer
from fedcp_dist.algorithms.fedphp import FedPHP
from fedcp_dist.algorithms.fedprox import FedProx
from fedcp_dist.algorithms.fedrep import FedRep
from fedcp_dist.algorithms.fedrod import FedRoD
from fedcp_dist.algorithms.perfedavg import PerFedAvg
from fedcp_dist.algorithms.pfedme import PFedMe
from fedcp_dist.comm.keys import CompressionOptions, Privacy, SelectionOptions

ALGORITHMS = {
    cls.name: cls
    for cls in (FedCP, FedAvg, FedProx, PerFedAvg, PFedMe, FedAMP, Ditto, FedPer, FedRep, FedRoD, FedFomo, FedPHP)
}


#: the classes whose options apply to every method alike: upload compression, client selection and
#: user-level differential privacy
SHARED_OPTION_CLASSES = (CompressionOptions, SelectionOptions, Privacy)
#: every class whose options are config keys: the methods, the parts a method is composed of (FedCP's),
#: and the shared ones
OPTION_CLASSES = (*(c for cls in ALGORITHMS.values() for c in (*getattr(cls, "parts", ()), cls)),
                  *SHARED_OPTION_CLASSES)


def option_classes() -> list:
    """The classes that declare options, each once, bases before subclasses."""
    seen = []
    for cls in OPTION_CLASSES:
        for c in reversed(cls.__mro__):
            if "options" in c.__dict__ and c not in seen:
                seen.append(c)
    return seen


def acting_option_classes(name: str) -> list:
    """The classes of :func:`option_classes` whose keys act on the method ``name``: its class and
    its bases, its parts, and the shared ones. The others' keys have no effect on it, and their
    checks across keys are not run for it."""
    cls = ALGORITHMS[name]
    owners = {c for owner in (*getattr(cls, "parts", ()), cls, *SHARED_OPTION_CLASSES) for c in owner.__mro__}
    return [c for c in option_classes() if c in owners]


def methods_using(option_class: type) -> list:
    """The names of the methods whose keys include ``option_class``'s."""
    return [name for name in ALGORITHMS if option_class in acting_option_classes(name)]


def method_options() -> list:
    """Every registered method's config options, in declaration order; a name declared twice is an error."""
    out, names = [], set()
    for cls in option_classes():
        for opt in cls.__dict__["options"]:
            assert opt.name not in names, f"config key {opt.name!r} is declared twice"
            names.add(opt.name)
            out.append(opt)
    return out


def algorithm_class(name: str, cfg) -> type:
    """The class of the method ``name`` (its options in ``cfg`` configure it; no key changes the class)."""
    return ALGORITHMS[name]


def make_algorithm(name: str, cfg, model, device) -> Algorithm:
    """The method ``name`` (:func:`algorithm_class`) built on ``model``."""
    return algorithm_class(name, cfg)(cfg, model, device)
