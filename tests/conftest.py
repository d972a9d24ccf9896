import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# submitit configures logging when it is imported (logging.config.dictConfig), which closes every
# handler that exists by then. dp-accounting imports absl, whose handler keeps the sys.stderr of the
# moment it was made and closes it unless it is sys.stderr at the time: under pytest, a capture file.
# A test that imported dp-accounting (the privacy tests) followed by one that imported submitit
# (the sweep's SLURM executor) in one worker left pytest writing to a closed file. Imported here,
# first, submitit's set-up finds no handler to close.
import submitit  # noqa: E402,F401
BIN = Path(sys.executable).parent

# A suite started in the background by a script (`make test &`, nohup) inherits SIGINT ignored, as
# POSIX has background jobs do; the stop tests send SIGINT on purpose, to this process (in-process
# runs) and to the processes it starts: give it back its default handler.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
FILE_SECONDS = {"test_failures.py": 175, "test_fault_harness.py": 100, "test_multiprocess.py": 150, "test_slurm.py": 140, "test_resume.py": 130,
                "test_golden.py": 105, "test_baselines.py": 100, "test_fedcp_switch_runs.py": 100,
                "test_client_store.py": 85, "test_privacy_runs.py": 75, "test_edge_data.py": 65}


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


def downsampled(src: Path, out: Path, size: int = 16) -> Path:
    """The shard ``src`` (images) with every image area-averaged to ``size`` x ``size``: the same
    clients, samples and labels, written through the shard writer. The 4-layer CNN then costs about
    a tenth of its 28 x 28 arithmetic (conv 5x5 leaves a 1 x 1 map, a 64-wide flatten), for the
    whole-run tests whose checks (world sizes, resume, uploads) do not depend on the image size."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from fedcp_dist.data.shards import load_clients, read_info, write_shard

    info = read_info(src)
    clients = load_clients(src, list(range(info.num_clients)))

    def shrink(x):
        t = F.interpolate(torch.from_numpy(np.asarray(x)).float(), size=(size, size), mode="area")
        return t.round().clamp(0, 255).to(torch.uint8).numpy()

    write_shard(out, [(shrink(c["train_x"]), c["train_y"], shrink(c["test_x"]), c["test_y"]) for c in clients.values()],
                source=info.source, num_classes=info.num_classes, input_shape=(info.input_shape[0], size, size),
                mean=info.mean, std=info.std, partition=info.partition, partition_params=info.partition_params,
                seed=info.seed)
    return out


@pytest.fixture(scope="session")
def digits20_16px(digits20, tmp_path_factory) -> Path:
    """:func:`digits20` at 16 x 16 pixels (see :func:`downsampled`)."""
    return downsampled(digits20, tmp_path_factory.mktemp("shards") / "digits_dir0.1_n20_16px.h5")


@pytest.fixture(scope="session")
def digits6_16px(digits6, tmp_path_factory) -> Path:
    """:func:`digits6` at 16 x 16 pixels (see :func:`downsampled`)."""
    return downsampled(digits6, tmp_path_factory.mktemp("shards") / "digits_dir0.5_n6_16px.h5")


def run_cmd(cmd, timeout=300, env_extra=None):
    """Run a command from the repo root with the test interpreter's venv first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("FEDCP_LAUNCHER", None)
    if env_extra:
        env.update(env_extra)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
