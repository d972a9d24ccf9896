import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (``make test``), worker gwN keeps every ``count``-th CPU from the N-th on,
    so two workers on two cores each run on one core (their runs pick their threads from it)
    instead of both asking for every core and spinning against each other; the processes a
    test starts inherit it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= count:
        ALL_CPUS.update(cpus)
        os.sched_setaffinity(0, cpus[int(worker[2:]) % count :: count])


#: every CPU this process could use before an xdist worker kept its own (empty: not pinned)
ALL_CPUS: set = set()


def unpinned() -> None:
    """``preexec_fn`` for daemons a test starts (the SLURM cluster): every CPU again, so that they
    see the machine as it is, not the worker's share."""
    if ALL_CPUS:
        os.sched_setaffinity(0, ALL_CPUS)


def pytest_configure(config):
    _pin_xdist_worker()
    config.addinivalue_line(
        "markers", "slow: takes 10 s or more (processes, launchers, many rounds); `-m 'not slow'` skips them")


#: seconds of the slowest files on one pinned core (make test, 2-core machine): they start first,
#: longest first, so that the two workers finish together
FILE_SECONDS = {"test_failures.py": 175, "test_multiprocess.py": 150, "test_slurm.py": 140, "test_resume.py": 130,
                "test_golden.py": 105, "test_baselines.py": 100, "test_fedcp_switch_runs.py": 100,
                "test_client_store.py": 85, "test_edge_data.py": 65}


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first, the longest of them first (each file's tests in their order):
    under pytest-xdist's ``--dist loadfile`` the long ones then start early and the fast files fill
    in around them, instead of one long file running alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in slow_files, -FILE_SECONDS.get(item.path.name, 0)))


@pytest.fixture
def float64():
    """float64 as torch's default dtype for the test (exact comparisons of two paths)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def partition(out: Path, *args: str) -> Path:
    from fedcp_dist.cli.partition import main

    main([*args, "--out", str(out), "--force"])
    return out


@pytest.fixture(scope="session")
def digits20(tmp_path_factory) -> Path:
    """The embedded default: digits, 20 clients, Dir(0.1), seed 1."""
    out = tmp_path_factory.mktemp("shards") / "digits_dir0.1_n20.h5"
    return partition(out, "--source", "digits", "--partition", "dir", "--beta", "0.1", "--num-clients", "20", "--seed", "1")


@pytest.fixture(scope="session")
def digits6(tmp_path_factory) -> Path:
    """A small partition for multi-process runs: digits, 6 clients, Dir(0.5)."""
    out = tmp_path_factory.mktemp("shards") / "digits_dir0.5_n6.h5"
    return partition(out, "--source", "digits", "--partition", "dir", "--beta", "0.5", "--num-clients", "6", "--seed", "2")


def run_cmd(cmd, timeout=300, env_extra=None):
    """Run a command from the repo root with the test interpreter's venv first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("FEDCP_LAUNCHER", None)
    if env_extra:
        env.update(env_extra)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
