"""Builders the tests share: in-process runs, and an algorithm wrapper that injects a fault."""
from __future__ import annotations

import sys

import torch

from fedcp_dist.config import load_config
from fedcp_dist.errors import cli_main
from fedcp_dist.runtime import init_runtime
from fedcp_dist.simulator import Simulator


class NonFiniteAt:
    """Wraps an algorithm so that one client's result in one round (1-based) turns NaN: its
    upload, or its new state when it uploads nothing. Everything else is the algorithm's."""

    def __init__(self, algo, round_: int, client: int):
        self.__dict__.update(algo=algo, round=round_, client=client)

    def __getattr__(self, name):
        return getattr(self.algo, name)

    def __setattr__(self, name, value):
        setattr(self.algo, name, value)

    def _poison(self, res, ctx):
        if (ctx.round + 1, ctx.client) == (self.round, self.client):
            target = res.upload or res.client_state
            first = next(iter(target))
            target[first] = target[first] * float("nan")
        return res

    def local_train(self, state, data, ctx):
        return self._poison(self.algo.local_train(state, data, ctx), ctx)

    def train_fused(self, items):
        for (_, _, ctx), res in zip(items, self.algo.train_fused(items)):
            yield self._poison(res, ctx)


def nonfinite_at(spec: str):
    """``"ROUND:CLIENT"`` → a ``wrap`` for :class:`Simulator` that injects :class:`NonFiniteAt`."""
    r, c = (int(v) for v in spec.split(":"))
    return lambda algo: NonFiniteAt(algo, r, c)


def run(config: str, overrides, wrap=None, echo=lambda *_: None) -> dict:
    """One run in this process (one rank), as ``fedcp-run`` would do it; returns its summary."""
    cfg = load_config(config, list(overrides))
    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout, env={})
    try:
        return Simulator(cfg, rt, echo=echo, wrap=wrap).run()
    finally:
        rt.close()


@cli_main
def _main(argv):
    """``python tests/helpers.py ROUND:CLIENT --config C key=value ...`` under any launcher: a run
    whose client CLIENT produces a NaN update in round ROUND (exit codes as fedcp-run's)."""
    from fedcp_dist.run import build_parser

    args = build_parser().parse_args(argv[1:])
    cfg = load_config(args.config, args.overrides)
    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout)
    try:
        Simulator(cfg, rt, wrap=nonfinite_at(argv[0])).run()
    finally:
        rt.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _main(sys.argv[1:])
