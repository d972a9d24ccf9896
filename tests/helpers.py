"""Builders the tests share: in-process runs, a fake runtime, a fault-injecting algorithm wrapper and
an algorithm stand-in, small clients and models, and processes started and killed as a scheduler would."""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import BIN, REPO
from fedcp_dist.config import Config, load_config
from fedcp_dist.data.resident import ClientData, to_device
from fedcp_dist.models import build_model
from fedcp_dist.errors import cli_main
from fedcp_dist.runtime import init_runtime
from fedcp_dist.engine.simulator import Simulator


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

    def finish(self, state, outcomes, ctx):  # the fused path's end of a client's training
        return self._poison(self.algo.finish(state, outcomes, ctx), ctx)


def nonfinite_at(spec: str):
    """``"ROUND:CLIENT"`` → a ``wrap`` for :class:`Simulator` that injects :class:`NonFiniteAt`."""
    r, c = (int(v) for v in spec.split(":"))
    return lambda algo: NonFiniteAt(algo, r, c)


def client_state_saves_fail(save, n: int):
    """``save`` (torch.save) as on a disk that fills up at the ``n``-th file of a disk client store
    (1-based; a name holding ``.client_``): that call writes part of the file, then it and every
    later one raise OSError(ENOSPC). Other files are saved as ``save`` does."""
    calls = {"n": 0}

    def flaky(obj, f, *args, **kwargs):
        name = str(getattr(f, "name", f))
        if ".client_" in name:
            calls["n"] += 1
            if calls["n"] >= n:
                if hasattr(f, "write"):
                    f.write(b"partial")
                else:
                    Path(f).write_bytes(b"partial")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(obj, f, *args, **kwargs)

    return flaky


def rank_envs(world_size: int = 2) -> list:
    """The environments of ``world_size`` ranks started by hand, as mpirun's or srun's ranks meet
    (torchrun's variables, no torchrun agent, so rank 0 holds the rendezvous store): a free port
    on this host, one thread each, the venv first on PATH, no forced launcher."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    envs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        env.pop("FEDCP_LAUNCHER", None)
        envs.append(env)
    return envs


def run_hand_ranks(commands: list, envs: list, timeout: float = 180) -> list:
    """Start one process per (command, environment) (ranks started by hand, see :func:`rank_envs`)
    in the repository, wait for all of them (killing what is left when waiting fails) and return
    each one's (returncode, stdout, stderr)."""
    from conftest import REPO

    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in zip(commands, envs)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    """``folder`` on a tmpfs of ``size`` (``256k``, ``1m``): a disk that fills. Mounting needs root:
    the test is skipped where it fails."""
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def run(config: str, overrides, wrap=None, echo=lambda *_: None) -> dict:
    """One run in this process (one rank), as ``fedcp-run`` would do it; returns its summary."""
    cfg = load_config(config, list(overrides))
    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout, env={})
    try:
        return Simulator(cfg, rt, echo=echo, wrap=wrap).run()
    finally:
        rt.close()


# One process per world runs its jobs in turn, as fedcp_dist.run's main does (config → runtime →
# Simulator → run) but on one process group for all of them (torchrun's store does not take a second).
_WORLD_DRIVER = r"""
import json, sys
from fedcp_dist.config import load_config
from fedcp_dist.run import build_parser
from fedcp_dist.runtime import init_runtime
from fedcp_dist.engine.simulator import Simulator

cfgs = [load_config(a.config, a.overrides) for a in map(build_parser().parse_args, json.load(open(sys.argv[1])))]
rt = init_runtime(cfgs[0].device, cfgs[0].threads, cfgs[0].collective_timeout)
try:
    for cfg in cfgs:
        Simulator(cfg, rt).run()
finally:
    rt.close()
"""


def runs_on_one_and_two_ranks(root: Path, jobs: dict, timeout: float = 600) -> dict:
    """Every job (name → (config, overrides_for)) on one rank and on two ranks under torchrun, both
    worlds at once, each world one process running its jobs in turn (Python and torch start twice,
    not twice per job); job ``name`` writes to root/one/name and root/two/name. Returns each world's
    standard output ({"one": ..., "two": ...}); a world that fails fails the test with its stderr."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "driver.py").write_text(_WORLD_DRIVER)
    procs = {}
    for label, cmd in (("one", [sys.executable]),
                       ("two", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])):
        argvs = [["--config", config, *overrides_for(root / label / name)] for name, (config, overrides_for) in jobs.items()]
        (root / f"{label}.json").write_text(json.dumps(argvs))
        procs[label] = subprocess.Popen([*cmd, str(root / "driver.py"), str(root / f"{label}.json")], cwd=REPO,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
    outs = {}
    for label, p in procs.items():
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"{label}: {err[-4000:]}"
        outs[label] = out
    return outs


def load_run(out: Path) -> tuple:
    """(final global state, the accuracies of metrics.jsonl in order, its round records) of a run."""
    import json

    state = torch.load(out / "final_global.pt", weights_only=True)
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return state, [l["acc"] for l in lines if "acc" in l], [l for l in lines if l.get("kind") == "round"]


def assert_states_close(a: dict, b: dict, atol: float = 1e-5, label: str = "") -> None:
    assert set(a) == set(b), f"{label} keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{label} {k} differs by {(a[k] - b[k]).abs().max()}"


def resume_before_last_checkpoint(config: str, overrides_for, done: Path, resumed: Path, rounds: int) -> tuple:
    """A copy of the finished run ``done`` as it stood at its previous checkpoint (the summary, the
    final model and the last round's checkpoint removed), continued to the end in this process;
    :func:`load_run` of the result."""
    import shutil

    shutil.copytree(done, resumed)
    for p in ("summary.json", "final_global.pt"):
        (resumed / p).unlink()
    shutil.rmtree(resumed / "checkpoints" / f"round_{rounds:07d}")
    run(config, overrides_for(resumed))
    return load_run(resumed)


class FakeRuntime:
    """What the engine uses of :class:`~fedcp_dist.runtime.Runtime`, for tests in one process: rank
    ``rank`` of ``world_size``, whose collectives add what the other ranks hand in, ``others`` (their
    tensors, filled by the time of the collective; none: a collective hands back this rank's own)."""

    def __init__(self, world_size: int = 1, rank: int = 0, others=(), device="cpu", launcher: str = "single",
                 threads: int = 1):
        self.world_size, self.rank, self.others = world_size, rank, list(others)
        self.device, self.launcher, self.threads, self.phase = torch.device(device), launcher, threads, "start-up"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        for other in self.others:
            t.add_(other.to(t.device, t.dtype))
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t, *self.others])

    def barrier(self) -> None:
        pass


class Recorder:
    """An algorithm stand-in that records what the store hands it."""

    def __init__(self):
        self.globals, self.inits = [], []

    def set_global(self, gs):
        self.globals.append(dict(gs))

    def init_client_state(self, cid):
        self.inits.append(cid)
        return {"w": torch.full((2,), float(cid))}


def partition_shares(labels, num_classes: int, kind: str, num_clients: int, seed: int, **options) -> list:
    """The ``(train_idx, test_idx)`` pairs of :func:`~fedcp_dist.data.partition.partition_clients`."""
    from fedcp_dist.data.partition import partition_clients

    return partition_clients(labels, num_classes, kind, num_clients, seed, **options).shares


# ---------------------------------------------------------------- small clients and models

CPU = torch.device("cpu")


class Data64(ClientData):
    """A client whose batches come in float64 (for the exactness checks)."""

    def train_batch(self, idx=None):
        x, y = super().train_batch(idx)
        return x.double(), y


def random_client(cid, n, classes=10, shape=(1, 28, 28), double=False):
    g = torch.Generator().manual_seed(100 + cid)
    arrays = {
        "train_x": torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8).numpy(),
        "train_y": torch.randint(0, classes, (n,), generator=g).numpy(),
        "test_x": torch.randint(0, 256, (2, *shape), generator=g, dtype=torch.uint8).numpy(),
        "test_y": torch.randint(0, classes, (2,), generator=g).numpy(),
    }
    d = to_device(cid, arrays, (0.5,), (0.5,), CPU)
    return Data64(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)}) if double else d


def algo_with_moved_global(cls, net=None, shape=(1, 28, 28), **kw):
    kw.setdefault("lr", 0.05)
    kw.setdefault("batch_size", 10)
    cfg = Config(**kw)
    torch.manual_seed(0)
    algo = cls(cfg, net if net is not None else build_model("cnn", shape, 10), CPU)
    gs = algo.init_global_state()
    # a global state that differs from the initial one, so the shared and personal parts differ
    gs = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(7)) for k, v in gs.items()}
    algo.set_global(gs)
    return algo, gs



class Tiny(nn.Module):
    """features: 2x2 image → Linear(4, 3) → ReLU; head: Linear(3, 3). Small enough to redo by hand."""

    def __init__(self):
        super().__init__()
        self.feature_dim = 3
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU())
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.features(x))


class SmallTanh(Tiny):
    """Tiny with a Tanh feature (K = 3): no dead features, so every part gets a gradient."""

    def __init__(self):
        super().__init__()
        self.features[2] = nn.Tanh()


def tiny_fedcp(net=None, **kw):
    """FedCP on ``net()`` (default :class:`SmallTanh`), built after seeding, with a received global
    state that differs from the working modules' values (so the MMD against the received extractor
    is not 0). (algorithm, that global state)"""
    from fedcp_dist.algorithms.fedcp import FedCP

    kw.setdefault("lr", 0.1)
    kw.setdefault("batch_size", 8)
    kw.setdefault("lam", 0.5)
    kw.setdefault("rounds", 6)
    cfg = Config(**kw)
    torch.manual_seed(0)
    algo = FedCP(cfg, (net or SmallTanh)(), CPU)
    gs = algo.init_global_state()
    g = torch.Generator().manual_seed(7)
    gs = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in gs.items()}
    algo.set_global(gs)
    return algo, gs


def tiny_data(n=8, shape=(1, 2, 2), labels=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(labels if labels is not None else [i % 3 for i in range(n)])
    arrays = {
        "train_x": torch.randint(0, 256, (len(y), *shape), generator=g, dtype=torch.uint8).numpy(),
        "train_y": y.numpy(),
        "test_x": torch.randint(0, 256, (3, *shape), generator=g, dtype=torch.uint8).numpy(),
        "test_y": torch.tensor([0, 1, 2]).numpy(),
    }
    return to_device(0, arrays, (0.5,), (0.5,), CPU)



# ---------------------------------------------------------------- processes


def start(cmd, **env_extra):
    """Start ``cmd`` from the repository in a session of its own (stdout and stderr together)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1", **env_extra)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for(path: Path, proc, timeout=240):
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"run ended before {path} appeared:\n{proc.stdout.read()[-3000:]}"
        assert time.time() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (see :func:`fedcp_dist.interrupts.descendants`)."""
    from fedcp_dist.interrupts import descendants as below

    return [pid, *below(pid)]


def kill_job(proc) -> None:
    """SIGKILL the launcher and every process under it, as a scheduler ends a job."""
    for p in descendants(proc.pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)



@cli_main
def _main(argv):
    """``python tests/helpers.py ROUND:CLIENT --config C key=value ...`` under any launcher: a run
    whose client CLIENT produces a NaN update in round ROUND (exit codes as fedcp-run's).
    ``python tests/helpers.py full-disk:RANK:N ...``: the disk of rank RANK's client store fills up
    at its N-th file (:func:`client_state_saves_fail`)."""
    from fedcp_dist.run import build_parser

    args = build_parser().parse_args(argv[1:])
    cfg = load_config(args.config, args.overrides)
    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout)
    wrap = None
    if argv[0].startswith("full-disk:"):
        rank, n = (int(v) for v in argv[0].split(":")[1:])
        if rt.rank == rank:
            torch.save = client_state_saves_fail(torch.save, n)
    else:
        wrap = nonfinite_at(argv[0])
    try:
        Simulator(cfg, rt, wrap=wrap).run()
    finally:
        rt.close()


class PreemptAt:
    """A method wrapper (``run(..., wrap=lambda a: PreemptAt(a, r))``) that sends the preemption
    signal to this process while round ``r`` (1-based) trains: the run checkpoints after that round
    and stops as a preempted job does. Needs ``fused=false`` (it wraps ``local_train``)."""

    def __init__(self, algo, r):
        self.__dict__.update(algo=algo, r=r)

    def __getattr__(self, name):
        return getattr(self.algo, name)

    def __setattr__(self, name, value):
        setattr(self.algo, name, value)

    def local_train(self, state, data, ctx):
        if ctx.round + 1 == self.r:
            os.kill(os.getpid(), signal.SIGUSR2)
        return self.algo.local_train(state, data, ctx)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _main(sys.argv[1:])


# ---------------------------------------------------------------- data sets in their real on-disk formats

CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def write_pickle(path, obj, legacy=False):
    """Pickle ``obj`` with protocol 2 as the CIFAR files are; ``legacy`` names numpy's array
    rebuilder by its old module path, as files pickled by an old numpy do."""
    data = pickle.dumps(obj, protocol=2)
    if legacy:
        assert b"numpy._core.multiarray" in data
        data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    Path(path).write_bytes(data)


def make_cifar10(root, per_file=10, seed=0, learnable=False):
    """cifar-10-batches-py/ with ``per_file`` random images in each of the 6 batches; ``learnable``
    draws labels 0 and 1 only, with dark and bright images."""
    rng = np.random.default_rng(seed)
    base = Path(root) / "cifar-10-batches-py"
    base.mkdir(parents=True)
    rows, labels = [], []
    for i, name in enumerate(CIFAR10_FILES):
        data = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, per_file)]
        if learnable:
            y = [int(v) for v in rng.integers(0, 2, per_file)]
            data = (np.asarray(y)[:, None] * 180 + rng.integers(20, 60, (per_file, 3072))).astype(np.uint8)
        write_pickle(base / name, {b"batch_label": f"batch {i}".encode(), b"labels": y,
                                   b"data": data,
                                   b"filenames": [f"img_{i}_{j}.png".encode() for j in range(per_file)]})
        rows.append(data)
        labels += y
    write_pickle(base / "batches.meta", {b"num_cases_per_batch": per_file, b"num_vis": 3072,
                                         b"label_names": [f"class{k}".encode() for k in range(10)]})
    return np.concatenate(rows), np.asarray(labels, dtype=np.int64)


CLASS_WORDS = {1: "world war election", 2: "sports match goal", 3: "business market stock",
               4: "science space computer"}


def agnews_rows(n_per_class, offset, extra=""):
    rows = []
    for j in range(n_per_class):
        for k, words in CLASS_WORDS.items():
            rows.append((str(k), f"Item{offset + j} {words.split()[j % 3]} (Reuters)",
                         f"{words} \"quoted\" news{extra}"))
    return rows


def write_agnews(folder, train_rows, test_rows):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.csv", train_rows), ("test.csv", test_rows)):
        with open(folder / name, "w", newline="", encoding="utf-8") as f:
            csv.writer(f, quoting=csv.QUOTE_ALL, lineterminator="\n").writerows(rows)


def quarters_shard(folder: Path) -> Path:
    """4 clients of 16–24 learnable 28×28 images (class = which quarter is bright), 6 test each, as
    ``folder/small.h5``."""
    from fedcp_dist.cli.partition import main

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        (folder / split).mkdir()
    for i, n in enumerate((24, 16, 20, 18)):
        for split, m in (("train", n), ("test", 6)):
            y = rng.integers(0, 4, m) if i % 2 == 0 else rng.integers(1, 3, m)
            x = rng.integers(0, 60, (m, 1, 28, 28)).astype(np.uint8)
            for j, c in enumerate(y):
                x[j, 0, (c // 2) * 14:(c // 2) * 14 + 14, (c % 2) * 14:(c % 2) * 14 + 14] += 180
            np.savez_compressed(folder / split / f"{i}.npz", x=x, y=y)
    out = folder / "small.h5"
    main(["--from-npz", str(folder), "--out", str(out), "--source", "quarters", "--num-classes", "4"])
    return out


def expect_user_error(capsys, argv, *fragments):
    """``fedcp-partition argv`` in-process: exit 2 with one ``error: …`` line holding every fragment."""
    from fedcp_dist.cli.partition import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert str(fragment) in err, err
    return err


def documented(page: str, example: str, actual: str = None) -> None:
    """The docs page ``page`` (a file under docs/) quotes ``example`` (whitespace aside), and, given
    what a run printed, ``actual`` matches it: every piece of the example between its ``…``
    placeholders (markdown's backticks left out) appears in ``actual``, in order. A test of a
    behaviour that calls this also fails when the docs stop promising it, or promise other words
    than the run prints."""
    text = " ".join((REPO / "docs" / page).read_text(encoding="utf-8").split())
    example = " ".join(example.split())
    assert example in text, f"docs/{page} no longer says: {example}"
    if actual is not None:
        actual, at = " ".join(actual.split()), 0
        for piece in (p.replace("`", "").strip() for p in example.split("…")):
            found = actual.find(piece, at)
            assert found >= 0, f"{piece!r} (docs/{page}) not in {actual!r} after position {at}"
            at = found + len(piece)

