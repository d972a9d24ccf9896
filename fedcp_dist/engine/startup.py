"""Start-up on every rank: the shard checked against the config, clients placed on ranks, this
rank's clients loaded onto its device, budgets checked, and every rank agreeing before any trains.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import torch

from fedcp_dist.fused import slots as fused
from fedcp_dist.engine import preflight
from fedcp_dist.engine.agreement import digest64
from fedcp_dist.algorithms import Algorithm, make_algorithm
from fedcp_dist.capabilities import PeerExchange, supports
from fedcp_dist.fused.groups import group_size as fused_group_size, one_thread_each, workers_for
from fedcp_dist.state.client_store import banks_in_files
from fedcp_dist.data.resident import OnDemandData, ResidentData, to_device
from fedcp_dist.data.shards import ShardInfo, ShardReader, load_clients, read_info
from fedcp_dist.data.shards.read import layout_digest_of
from fedcp_dist.fused import memory as fused_memory
from fedcp_dist.data.shards.verify import ShardDigest, verify_shard
from fedcp_dist.errors import ONE_TERMINAL, UserError, first_line
from fedcp_dist.rundir.faults import fault_point
from fedcp_dist.models import MODEL_KINDS, build_model, model_options
from fedcp_dist.state.placement import (client_subset, eval_sample, form_groups, imbalance, max_cohort_size, place_clients,
                                        place_groups, placement_rule, placement_weights, steps_per_rank)


@dataclass
class Setup:
    """What a rank knows after start-up."""

    info: ShardInfo
    #: the shard's ids of the run's clients (``data.clients``; all by default), sorted. The run
    #: numbers its clients 0 … len − 1 in this order: client k of the run is shard client clients[k]
    clients: np.ndarray
    owner: np.ndarray  # owner rank of every client of the run
    owned: List[int]  # this rank's clients
    #: this rank's clients' data (:func:`load_data`): resident on its device, or read from the shard
    #: as rounds need them (``client_data``); None before :func:`load_data`
    data: Optional[Union[ResidentData, OnDemandData]]
    load_seconds: float
    #: what the clients were weighted by when placed (``samples`` or ``steps``, see config key ``placement``)
    placement: str = "samples"
    #: every rank's local SGD steps in a round in which all the run's clients train
    rank_steps: Optional[np.ndarray] = None
    #: the run's fused groups (client ids of the run, each sorted; see :func:`fedcp_dist.state.placement.form_groups`),
    #: placed whole; None: the clients train one by one
    groups: Optional[List[np.ndarray]] = None
    #: what the shard holds, hashed and checked against what was written with it (the first rank's;
    #: None on the others): what checkpoints record and resume compares
    digest: Optional[ShardDigest] = None
    #: the shard's layout digest (:func:`~fedcp_dist.data.shards.layout_digest`; the first rank's,
    #: streamed from the file once: None on the others)
    layout: Optional[str] = None
    #: the run's clients that every evaluation evaluates (``eval_clients``), sorted
    eval_ids: Optional[np.ndarray] = None
    #: the largest cohort a round may draw (the rows of the all-reduce that follow the cohort)
    max_cohort: int = 0
    #: resident | on_demand (``client_data``) and why
    data_mode: str = "resident"
    data_why: str = ""

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' steps (1.0: balanced)."""
        return imbalance(self.rank_steps) if self.rank_steps is not None else 1.0

    def placement_line(self) -> str:
        """How the start line says the clients were placed."""
        whole = f" in {len(self.groups)} whole fused groups" if self.groups is not None else ""
        line = (f"placed by {self.placement}{whole}, max/mean steps per rank {self.imbalance:.3f} "
                f"({'/'.join(str(int(s)) for s in self.rank_steps)})")
        world = len(self.rank_steps)
        idle = world - len({int(self.owner[g[0]]) for g in self.groups if len(g)}) if self.groups is not None else 0
        if idle > 0:  # groups are fixed by the configuration, not by the world size: say how to use every rank
            line += (f", {idle} of {world} ranks hold no fused group (fused_group={max(1, self.num_clients // world)} "
                     f"gives each rank one)")
        return line

    def owned_groups(self, rank: int) -> List[List[int]]:
        """The fused groups ``rank`` owns, in the run's order (empty when not fused)."""
        return [[int(c) for c in g] for g in (self.groups or []) if len(g) and self.owner[g[0]] == rank]

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def owned_eval(self, rank: int) -> List[int]:
        """The evaluated clients ``rank`` owns, in client order."""
        ids = self.eval_ids if self.eval_ids is not None else np.arange(self.num_clients)
        return [int(c) for c in ids[self.owner[ids] == rank]]

    def eval_line(self) -> str:
        """How the start line says which clients are evaluated."""
        k = len(self.eval_ids) if self.eval_ids is not None else self.num_clients
        if k >= self.num_clients:
            return f"evaluation: every client ({self.num_clients})"
        return f"evaluation: {k} of the {self.num_clients} clients (eval_clients, drawn once from the seed)"

    def data_line(self) -> str:
        """How the start line says where the clients' data are."""
        if self.data_mode == "on_demand":
            return (f"clients' data read from the shard as rounds need them (client_data=on_demand"
                    f"{', ' + self.data_why if self.data_why else ''})")
        return f"loaded in {self.load_seconds:.2f} s"

    def batch_rows(self, cfg) -> int:
        """Rows of a training batch at most: ``batch_size``, or the run's largest client's training
        samples when fewer (the same on every rank; see :func:`fedcp_dist.fused.slots.batch_rows`)."""
        return fused.batch_rows(cfg.batch_size, self.info.train_counts[self.clients])

    def clients_per_rank(self, world_size: int) -> np.ndarray:
        return np.bincount(self.owner, minlength=world_size)


def check_shard(cfg, info: ShardInfo) -> None:
    """The config's expectations of the shard (``data.num_clients``, ``data.source``,
    ``data.input_shape``) against what the file holds."""
    d = cfg.data
    if d.num_clients and d.num_clients != info.num_clients:
        raise UserError(f"config key 'data.num_clients' is {d.num_clients} but {d.path} holds {info.num_clients} clients")
    if d.source and d.source != info.source:
        raise UserError(f"config key 'data.source' is {d.source!r} but {d.path} holds {info.source!r}")
    wants = MODEL_KINDS.get(cfg.model)
    if wants and wants != info.kind:
        raise UserError(f"config key 'model': {cfg.model!r} reads {wants} shards but {d.path} holds "
                        f"{info.kind} data (model: {', '.join(m for m, k in MODEL_KINDS.items() if k == info.kind)})")
    if d.input_shape is not None and list(d.input_shape) != list(info.input_shape):
        raise UserError(f"config key 'data.input_shape' is {list(d.input_shape)} but {d.path} holds inputs of "
                        f"shape {list(info.input_shape)}")
    if isinstance(d.clients, list) and max(d.clients) >= info.num_clients:
        raise UserError(f"config key 'data.clients' lists client {max(d.clients)} but {d.path} holds clients "
                        f"0..{info.num_clients - 1}")
    if isinstance(d.clients, int) and d.clients > info.num_clients:
        raise UserError(f"config key 'data.clients' asks for {d.clients} clients but {d.path} holds "
                        f"{info.num_clients}")


def run_clients(cfg, info: ShardInfo) -> np.ndarray:
    """The shard's ids of the run's clients, checked against the shard (see :class:`Setup`)."""
    check_shard(cfg, info)
    clients = client_subset(cfg.data.clients, cfg.seed, info.num_clients)
    if not int(info.test_counts[clients].sum()):
        # each client is evaluated on its own test samples; a client without any weighs nothing in the
        # sums, but with none anywhere every accuracy would be a 0 / 0
        of = "" if cfg.data.clients is None else f" (the {len(clients)} of config key 'data.clients')"
        raise UserError(f"the clients of {cfg.data.path}{of} hold no test sample: there is nothing to evaluate "
                        f"(fedcp-partition splits each client's samples by --train-ratio)")
    return clients


def model_for_shard(cfg, info: ShardInfo) -> torch.nn.Module:
    """The config's model built for the shard's inputs and tried on two zero samples of them (in
    evaluation mode, no gradient, no random draw: the model and torch's RNG are left as they were).
    A model that cannot take them is a one-line UserError naming both, before any training."""
    shape = [int(s) for s in info.input_shape]
    what = f"the inputs of {cfg.data.path} ({info.source} {info.kind}s of shape {shape})"
    try:
        model = build_model(cfg.model, info.input_shape, info.num_classes, vocab_size=info.vocab_size,
                            **model_options(cfg))
    except ValueError as exc:
        raise UserError(f"config key 'model': {cfg.model!r} cannot take {what}: {exc}") from None
    x = torch.zeros(2, *shape, dtype=torch.long if info.vocab_size else torch.float32)
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            out = model(x)
    except (RuntimeError, ValueError, IndexError) as exc:
        first = first_line(exc)
        raise UserError(f"config key 'model': {cfg.model!r} cannot take {what}: {first}") from None
    finally:
        model.train(was_training)
    if tuple(out.shape) != (2, info.num_classes):
        raise UserError(f"config key 'model': {cfg.model!r} on {what} gives outputs of shape {list(out.shape[1:])}, "
                        f"not the shard's {info.num_classes} classes")
    return model


def build_method(cfg, info: ShardInfo, num_clients: int, device) -> Algorithm:
    """The run's method on its initial model: the config's seed, then the model for the shard
    (:func:`model_for_shard`), then the algorithm. The one place that draws them, in this order, so
    that every rank and every later rebuild of the run (:mod:`fedcp_dist.analysis.runstate`) starts
    from the same model."""
    torch.manual_seed(cfg.seed)
    algo = make_algorithm(cfg.method, cfg, model_for_shard(cfg, info), device)
    algo.num_clients = num_clients
    return algo


def place(cfg, train_counts, world_size: int, group_size: int = 0) -> Tuple[np.ndarray, str, np.ndarray]:
    """(owner rank of every client, the rule it was placed by, every rank's local steps in a round
    in which every client trains): a function of the config and the clients' sample counts alone,
    computed alike on every rank. ``group_size`` > 0: the clients train in fused groups of that
    size (:func:`form_groups`), placed whole."""
    rule = placement_rule(cfg.placement, cfg.fused)
    steps = placement_weights("steps", train_counts, cfg.batch_size, cfg.local_epochs, cfg.drop_last)
    weights = steps if rule == "steps" else placement_weights(rule, train_counts, cfg.batch_size,
                                                              cfg.local_epochs, cfg.drop_last)
    if group_size > 0:
        owner = place_groups(weights, form_groups(steps, group_size), world_size)
    else:
        owner = place_clients(weights, world_size)
    return owner, rule, steps_per_rank(steps, owner, world_size)


def load(cfg, rt, group_size: Optional[Callable[[ShardInfo, int], int]] = None) -> Setup:
    """Read the shard's metadata and place the clients (their data: :func:`load_data`, once the
    client store is made); the first rank hashes the whole shard and checks it
    (:func:`~fedcp_dist.data.shards.verify.verify_shard`: what was written with it, every label, a
    table's values) and takes its layout digest, the others check the clients they read. Every rank
    reads the per-client sample counts only, not the per-class ones, so that start-up's memory
    grows by 16 bytes a client. ``group_size(info, clients)``: the size of the run's fused groups
    (0: not fused)."""
    info = read_info(cfg.data.path, label_counts=False)
    digest = verify_shard(info) if rt.is_main else None
    layout = layout_digest_of(cfg.data.path, info) if rt.is_main else None
    clients = run_clients(cfg, info)
    counts = info.train_counts[clients]
    size = group_size(info, len(clients)) if group_size is not None else 0
    owner, rule, rank_steps = place(cfg, counts, rt.world_size, size)
    groups = None
    if size > 0:
        steps = placement_weights("steps", counts, cfg.batch_size, cfg.local_epochs, cfg.drop_last)
        groups = form_groups(steps, size)
    owned = [int(c) for c in np.flatnonzero(owner == rt.rank)]
    fault_point("shard")  # the fault tests' hook
    return Setup(info, clients, owner, owned, None, 0.0, rule, rank_steps, groups, digest, layout,
                 eval_sample(cfg.seed, len(clients), cfg.eval_clients),
                 max_cohort_size(len(clients), cfg.participation, cfg.participation_range,
                                 cfg.participation_sampling))


def data_mode(cfg, need: int, states_on_disk: bool, device) -> Tuple[str, str]:
    """(resident | on_demand, why) for ``client_data``: ``auto`` reads the data on demand where the
    client states are on disk (a run that keeps its memory off the population) or where this rank's
    data (``need`` bytes) would take more than a quarter of the memory available."""
    if cfg.client_data != "auto":
        return cfg.client_data, ""
    if states_on_disk:
        return "on_demand", "auto: client states on disk"
    free = min(limit for _, limit in preflight.host_free().limits)
    if torch.device(device).type == "cuda":
        free = min(free, fused_memory.available_memory(torch.device(device)))
    if need > free // 4:
        return "on_demand", f"auto: {preflight.mib(need)} of data against {preflight.mib(free)} available"
    return "resident", ""


def load_data(cfg, rt, s: Setup, states_on_disk: bool) -> None:
    """This rank's clients' data into ``s.data``: all of them onto its device (``resident``; refused
    in one line where they cannot fit in the memory free now), or the shard opened for reads of
    the clients each round needs (``on_demand``); see :func:`data_mode`."""
    counts = [int(s.info.train_counts[s.clients[c]] + s.info.test_counts[s.clients[c]]) for c in s.owned]
    s.data_mode, s.data_why = data_mode(cfg, preflight.resident_data_bytes(s.info, counts), states_on_disk, rt.device)
    t0 = time.perf_counter()
    if s.data_mode == "on_demand":
        s.data = OnDemandData(ShardReader(cfg.data.path), s.clients, s.info.mean, s.info.std, rt.device)
    else:
        preflight.check_data(s.info, counts, rt.rank, rt.device)
        arrays = load_clients(cfg.data.path, [int(s.clients[c]) for c in s.owned])
        s.data = ResidentData({c: to_device(c, arrays.pop(int(s.clients[c])), s.info.mean, s.info.std, rt.device)
                               for c in s.owned})
        del arrays
    s.load_seconds = time.perf_counter() - t0


def check_peer_memory(cfg, algo, num_clients: int, max_owned: int, world_size: int) -> int:
    """Bytes per rank of the method's other-client models plus the exchange buffer (``max_owned``:
    the rows a rank sends, :func:`~fedcp_dist.engine.preflight.peer_rows`); refuse over budget."""
    if not supports(algo, PeerExchange):
        return 0
    dim = algo.peer_dim
    mapped = banks_in_files(cfg.client_state, algo.device)  # then page cache, not the process's own memory
    need = (0 if mapped else algo.peer_memory_bytes(num_clients)) + world_size * max_owned * (dim + 1) * 4
    if need > cfg.peer_memory_mb * 2**20:
        raise UserError(
            f"config key 'peer_memory_mb': {cfg.method} needs {need / 2**20:.0f} MiB per rank for other clients' "
            f"models ({num_clients} clients, {dim} values each) but peer_memory_mb={cfg.peer_memory_mb:g}; raise "
            f"peer_memory_mb or use fewer clients"
        )
    return need


def training_path(cfg, algo, per_client_bn: bool) -> Tuple[bool, str]:
    """(fused?, how the run's start line says its clients train). ``fused=auto`` (the default) and
    ``fused=true`` train fused wherever the method and model can, one by one otherwise; the line
    names the setting and, when it falls back, why."""
    if cfg.fused is False:
        return False, "sequential (fused=false)"
    setting = "fused=auto" if cfg.fused == "auto" else "fused=true"
    why = "per-client BatchNorm statistics" if per_client_bn else algo.fused_reason()
    if why:
        return False, f"sequential ({setting}: {why})" if cfg.fused == "auto" else f"sequential ({setting} not used: {why})"
    size = fused_group_size(cfg, algo.device, algo.num_clients)
    groups = f"groups of {size}" + ("" if cfg.fused_group else " (fused_group=auto)")
    threads = torch.get_num_threads()
    workers = workers_for(cfg.fused_workers, algo.device, threads, 2)
    if workers > 1:  # e.g. "groups of 8 (fused_group=auto), 2 at once with 1 thread each (fused_workers=auto)"
        groups += f", {workers} at once with 1 thread each (fused_workers={cfg.fused_workers})"
    elif algo.device.type == "cpu" and threads > 1:  # fused_workers=1: the rounding follows the thread count
        groups += (f", one at a time with {threads} threads (fused_workers=1: the same trajectory on ranks "
                   f"of {threads} threads only)")
    return True, f"fused ({setting}, {groups})"


def arithmetic(cfg, rt, fused: bool, num_clients: int) -> str:
    """What sets the rounding of this run's training beside its config: the device (a CPU's vector
    instruction set, a GPU's model), the path, a fused group's size and the intra-op threads one
    computation runs on. Two runs alike in these and in the config compute the same bits; a run
    resumed under another (a requeue onto other nodes, another ``threads``) goes on equal up to
    floating-point rounding, which the resume says (:func:`arithmetic_note`). Gathered over the
    ranks: ranks that differ are said so (a client's bits then follow the rank it trains on)."""
    device = torch.device(rt.device)
    if device.type == "cuda":
        what = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        what = f"{device.type} ({torch.backends.cpu.get_cpu_capability()})"
    threads = torch.get_num_threads()
    if fused:
        what += f", fused groups of {fused_group_size(cfg, device, num_clients)}"
        threads = 1 if one_thread_each(cfg, device, threads) else threads
    else:
        what += ", sequential"
    if device.type == "cpu":
        what += f", {threads} thread{'s' if threads > 1 else ''} a computation"
    ranks = rt.all_gather(torch.tensor([digest64(what.encode())], dtype=torch.int64, device=rt.device)).cpu()
    return what if bool((ranks == ranks[0]).all()) else what + " on rank 0, otherwise on other ranks"


def arithmetic_note(before: Optional[str], now: str) -> str:
    """The resume's note when the checkpointed rounds were computed under another :func:`arithmetic`
    ("": the same, or a checkpoint from before it was recorded)."""
    if not before or before == now:
        return ""
    return (f"note: the rounds done were computed on {before}, the rest on {now}: the run goes on equal to an "
            f"uninterrupted one up to floating-point rounding, not bit for bit")


def start_line(cfg, rt, setup: Setup, path: str, store_line: str, note: str = "", idle=()) -> str:
    """The run's first line: method, clients, ranks, loading, placement, the training path, where
    client states live, the method's own note (e.g. FedCP's CPN cost) and the keys set in the config
    that have no effect in this run (``idle``: [(key, why)])."""
    of = f" of the shard's {setup.info.num_clients}" if cfg.data.clients is not None else ""
    d = setup.digest
    verified = (f" (content verified in {d.seconds:.2f} s{', kept in ' + d.cache if d.cache else ''})"
                if d is not None and not d.cached and d.seconds >= 0.5 else "")
    unused = ", ".join(f"{key}={getattr(cfg, key)} ({why})" for key, why in idle)
    return (f"fedcp_dist: {cfg.method} on {setup.num_clients}{of} clients ({setup.info.source}), {rt.describe()}, "
            f"{len(setup.owned)} clients on rank 0, {setup.data_line()}{verified}; "
            f"{setup.placement_line()}; {setup.eval_line()}; "
            f"training: {path}; {store_line}" + (f"; {note}" if note else "")
            + (f"; keys with no effect in this run: {unused}" if unused else "") + ranks_hint(rt))


def ranks_hint(rt) -> str:
    """For a run alone in one process on several CPU threads: where the faster launch is (threads
    in one process contend for the interpreter between the kernels; one rank per core does not)."""
    if rt.launcher == "single" and rt.device.type == "cpu" and rt.threads > 1:
        return "; one rank per core trains faster: fedcp-run --ranks auto (or torchrun)"
    return ""


def agree_on(rt, step: Callable[[], object]):
    """``step()`` on every rank; every rank stops (:func:`agree`) if it failed anywhere."""
    err, out = None, None
    try:
        out = step()
    except UserError as exc:
        err = exc
    agree(rt, err)
    return out


def agree(rt, err: Optional[UserError]) -> None:
    """Every rank stops if any rank failed (one tiny all-reduce), with that rank's message where
    it has one."""
    flag = torch.tensor([0.0 if err is None else 1.0], device=rt.device)
    rt.all_reduce_sum_(flag)
    if err is not None:
        raise err
    if flag.item() > 0:  # (under fedcp-run --ranks the other rank's line is on the same terminal)
        raise UserError("another rank failed to start (see its message)", said=os.environ.get(ONE_TERMINAL) == "1")


def all_ok(rt, ok: bool) -> bool:
    """True when ``ok`` holds on every rank (one tiny all-reduce)."""
    flag = torch.tensor([0.0 if ok else 1.0], device=rt.device)
    rt.all_reduce_sum_(flag)
    return flag.item() == 0
