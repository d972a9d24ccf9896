"""The config keys of a run's rounds and of the process each rank is, declared apart from the code
that reads them (local training: :mod:`fedcp_dist.local_train` and the methods; evaluation:
:mod:`fedcp_dist.engine.evaluation`; a diverged client: :mod:`fedcp_dist.engine.training`; the probes:
:mod:`fedcp_dist.engine.probes`; the process: :mod:`fedcp_dist.runtime`, :mod:`fedcp_dist.launch_env` and
:mod:`fedcp_dist.run`),
so that the configuration is assembled without the engine.
"""
from __future__ import annotations

from typing import Union

from fedcp_dist.capabilities import Probes, supports
from fedcp_dist.options import Component, Option, above, at_least, boolean_or_auto, described, finite, one_of, within

#: the values of ``amp``
AMP_MODES = ("none", "bf16")


class LocalSGD(Component):
    """Local training: plain SGD (no momentum) over each client's resident samples."""

    options = (
        Option("lr", 0.005, "local learning rate η (plain SGD, no momentum)",
               described("> 0", lambda v: finite(v) or (None if v > 0 else f"must be > 0, got {v}"))),
        Option("batch_size", 10, "local batch size B", above(0)),
        Option("local_epochs", 1, "local epochs E (at most 10,000: a round is not preempted before it ends)",
               within(1, 10_000)),
        Option("drop_last", True, "drop a last incomplete batch each epoch (the reference's data loader does)"),
        Option("amp", "none", "mixed precision of local training: none | bf16 (autocast; evaluation stays float32)",
               one_of(*AMP_MODES)),
    )


class Evaluation(Component):
    """Personalized evaluation of every client (or of a seeded sample of them) before a round's training."""

    options = (
        Option("eval_every", 1, "evaluate every this many rounds (before that round's training), and after the last "
               "round", above(0)),
        Option("eval_batch_size", 1000, "samples per forward pass at evaluation", above(0)),
        Option("eval_clients", 0, "evaluate this many of the run's clients, a sample drawn once from the run seed (the "
               "same clients on any world size, at every evaluation and on resume), so that an evaluation's cost "
               "follows the sample, not the population; 0 (or at least the run's clients): every client. "
               "metrics.jsonl, summary.json and the start line say which; fedcp-report shows it as a column only "
               "where the runs differ in it", at_least(0)),
    )


class NonFinite(Component):
    """What a round does with a client whose training diverged."""

    options = (
        Option("on_nonfinite", "error", "a client's non-finite loss or update: error (stop every rank) | skip (leave it "
               "out of the round)", one_of("error", "skip")),
    )


class Probing(Component):
    """The analysis probes (FedCP's policy)."""

    options = (
        Option("analysis", False, "probes for analysis.jsonl (FedCP): PIR and s histograms at every evaluation, PIR and "
               "the training loss before/after local learning of every trained client every analysis_every rounds; "
               "results are unchanged"),
        Option("analysis_every", 0, "take the training probes every this many rounds (rounds 1, k+1, 2k+1, ...); > 0 "
               "also turns analysis on", at_least(0)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.probe_every and not supports(cfg.method_class, Probes):
            return ("analysis" if cfg.analysis else "analysis_every",
                    f"{cfg.method} has no probes (they measure FedCP's policy)")
        return None


DEVICES = ("auto", "cpu", "cuda")
# SIGUSR1 is left alone: NCCL may use it
PREEMPT_SIGNALS = ("SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP")


class Execution(Component):
    """The process a rank is: its device, threads, allocator, collectives and signals."""

    options = (
        Option("device", "auto", "the device a rank computes on: auto (its GPU where there is one, else the CPU) | cpu | "
               "cuda", one_of(*DEVICES)),
        Option("threads", 0, "CPU threads per rank; 0 = cores / ranks on this node", within(0, 1024)),
        Option("keep_freed_memory", "auto", "CPU ranks: glibc's allocator keeps freed memory for reuse instead of "
               "returning large blocks to the system (whose pages then fault in again on every use): auto (on a CPU "
               "device under glibc) | true | false", boolean_or_auto, kind=Union[bool, str]),
        Option("collective_timeout", 600.0, "seconds a collective may wait for a peer before the run fails",
               described("> 0", lambda v: finite(v) or above(0)(v))),
        Option("rendezvous_timeout", 120.0, "seconds the ranks of a job may take to meet at start-up (MASTER_ADDR:"
               "MASTER_PORT) before the run fails, naming the address and the launcher's variables",
               described("> 0", lambda v: finite(v) or above(0)(v))),
        Option("preempt_signal", "SIGUSR2", "signal that asks the run to finish its round, checkpoint and exit with "
               "status 75 (SIGTERM too)", one_of(*PREEMPT_SIGNALS)),
    )
