"""The config keys of fused training, declared apart from the code that reads them
(:mod:`fedcp_dist.fused.groups`, :mod:`fedcp_dist.engine.startup`) so that the configuration can be
assembled without the training code."""
from __future__ import annotations

from typing import Union

from fedcp_dist.options import Component, Option, at_least, auto_or, boolean_or_auto, described, shown


class Fusing(Component):
    """Fused training: a group of a rank's clients trained at once as stacked parameters."""

    options = (
        Option("fused", "auto", "train a group of a rank's clients at once (stacked parameters, one forward/backward): "
               "auto where the method and model can (else one by one) | true (the same; the start line says when it "
               "cannot) | false", boolean_or_auto, kind=Union[bool, str]),
        Option("fused_group", 0, "clients per fused group (groups are fixed for the run and placed whole on ranks); "
               "0 (auto): about the device kind's slot cap (8 on a CPU, 256 on a GPU) × ⌈1 / participation⌉ clients, in a "
               "power-of-two number of equal groups, on a GPU at least 8 (a node's GPUs; 20 clients on a CPU: 4 groups of "
               "5, on a GPU: 7 of at most 3)", at_least(0)),
        Option("fused_join", "auto", "a rank trains the round's participants of all its fused groups as one set of "
               "slots: auto (on a GPU, whose kernels give a slot the same bits whatever the slots beside it; not on a "
               "CPU, where they differ in the last bits, so each group trains alone) | true | false",
               boolean_or_auto, kind=Union[bool, str]),
        Option("fused_workers", "auto", "fused groups trained side by side on a CPU rank, one thread each: auto (one "
               "per thread of the rank) | N (1: one group at a time over all the rank's threads)", auto_or(described(">= 1", lambda v: None if isinstance(v, int)
                                                              and not isinstance(v, bool) and v >= 1
                                                              else f"must be auto or an integer >= 1, got {shown(v)}")),
               kind=Union[int, str]),
    )
