"""The GPU path: NCCL on 2 ranks, 2 ranks sharing one GPU (gloo), bf16 autocast, a dead rank under
NCCL, fused groups sized on a GPU and trained jointly, each a real run of the launcher on the small
digits shard (2 rounds); in-process, the fused step against the sequential one in float64 and a
client's bits whatever the number of slots beside it. Skipped where no CUDA device is visible; the
NCCL tests need 2 GPUs (one rank per GPU). bench/gpu.sh runs this file and the GPU benchmarks.

Run on a GPU node: ``python -m pytest tests/test_cuda.py -q``.

Tolerances. A run of one world size is bit-reproducible on a CPU, but on a GPU float reductions are
not bit-exact (cuDNN and NCCL choose their own orders of addition), and cuDNN convolutions take
TF32 by default (inputs rounded to a 10-bit mantissa). The comparisons of global states therefore
run with ``NVIDIA_TF32_OVERRIDE=0`` (float32 arithmetic, the precision the project's float32
claims are about), and accuracies are compared in test samples of the shard (:func:`acc_tol`),
since a weight moved by rounding can flip a sample lying at a decision boundary.
"""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from conftest import REPO, run_cmd
from helpers import assert_states_close, descendants, kill_job, load_run, rank_envs, start

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
    pytest.mark.slow,
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"needs 2 CUDA devices, {torch.cuda.device_count()} visible: NCCL runs one rank per GPU")
nccl = pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()),
                          reason="this torch build has no NCCL backend (torch.distributed.is_nccl_available())")

ROUNDS = 2
#: float32 convolutions instead of cuDNN's default TF32, for the comparisons of global states
FLOAT32 = {"NVIDIA_TF32_OVERRIDE": "0"}
#: test samples by which the accuracies of 2 ranks (fused groups composed per rank, TF32 on, as a
#: user runs it) and 1 rank may differ. The docs state that fused results differ across world sizes
#: in the last bits; on a GPU they differ by rounding of TF32 convolutions too (about 1e-4 in a
#: weight). For scale, on the CPU bf16 autocast moved the global state of this run by 1.7e-3 and
#: its final accuracy by 1 sample of 451; a broken reduction (a rank's clients lost, a sum not
#: divided) moves it by tens of points.
RANK_SAMPLES = 5
#: the same where the global states agree within 1e-5 (1e-4 for fused against sequential)
CLOSE_SAMPLES = 2
#: bf16 autocast against float32: on the CPU (bf16 autocast's numerics) the digits run moved by 1
#: sample of 451 after 2 rounds, real MNIST by 0.04 points after 3 (docs/performance.md)
AMP_SAMPLES = 10
#: collective_timeout of the dead-rank runs, and what a rank may take beyond it to be gone:
#: torchrun waits 30 s between its SIGTERM and SIGKILL to a worker, NCCL's watchdog polls
DEAD_TIMEOUT = 30
DEAD_GRACE = 60


def _args(shard, out, *extra):
    return ["--config", "configs/digits_fedcp.yaml", "device=cuda", f"rounds={ROUNDS}", "eval_every=1",
            f"data.path={shard}", f"out_dir={out}", "threads=1", *extra]


def _torchrun(nproc: int = 2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


@dataclass
class Run:
    out: Path
    start_line: str
    state: dict
    accs: list
    summary: dict

    @property
    def training(self) -> str:
        """The start line's training path, e.g. ``fused (fused=auto, groups sized by memory)``."""
        m = re.search(r"; training: ([^;]*);", self.start_line)
        assert m, self.start_line
        return m.group(1)


def cuda_run(shard, out: Path, *extra, ranks: int = 1, env=None) -> Run:
    """A finished run of ``fedcp_dist.run`` on CUDA: 1 rank in one process, else torchrun."""
    launch = [sys.executable] if ranks == 1 else _torchrun(ranks)
    r = run_cmd([*launch, "-m", "fedcp_dist.run", *_args(shard, out, *extra)], timeout=600, env_extra=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [l for l in r.stdout.splitlines() if l.startswith("fedcp_dist: ") and "; training: " in l]
    assert len(lines) == 1, r.stdout[-3000:]
    state, accs, _ = load_run(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == ranks and summary["device"] == "cuda:0", summary
    assert len(accs) == ROUNDS + 1 and all(math.isfinite(a) for a in accs), accs
    return Run(out, lines[0], state, accs, summary)


def acc_tol(shard, samples: int) -> float:
    """``samples`` test samples of the shard, as a difference of sample-weighted accuracy."""
    from fedcp_dist.data.shards import read_info

    return samples / int(read_info(shard).test_counts.sum())


def assert_accs_close(a: Run, b: Run, tol: float, label: str) -> None:
    assert a.accs == pytest.approx(b.accs, abs=tol), f"{label}: {a.accs} vs {b.accs} (tolerance {tol:.4f})"
    assert a.summary["final_acc"] == pytest.approx(b.summary["final_acc"], abs=tol), label


# -- 1-rank references -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_fused(digits6, tmp_path_factory) -> Run:
    """1 rank on CUDA, the defaults (fused=auto, TF32 convolutions): what a user runs."""
    run = cuda_run(digits6, tmp_path_factory.mktemp("cuda_one_fused"))
    assert "world_size=1 device=cuda:0 backend=none" in run.start_line, run.start_line
    # it learned: the digits shard goes from about chance to over 80 % in 2 rounds on the CPU
    assert run.accs[-1] > run.accs[0] + 0.3, run.accs
    return run


@pytest.fixture(scope="module")
def one_fused_f32(digits6, tmp_path_factory) -> Run:
    """1 rank on CUDA, fused with groups sized by the rank (fused_group=0), float32 convolutions."""
    return cuda_run(digits6, tmp_path_factory.mktemp("cuda_one_fused_f32"), "fused=true", "fused_group=0",
                    env=FLOAT32)


@pytest.fixture(scope="module")
def one_seq_f32(digits6, tmp_path_factory) -> Run:
    """1 rank on CUDA, clients one by one (fused=false), float32 convolutions."""
    run = cuda_run(digits6, tmp_path_factory.mktemp("cuda_one_seq_f32"), "fused=false", env=FLOAT32)
    assert run.training == "sequential (fused=false)", run.start_line
    return run


# -- NCCL on 2 ranks ---------------------------------------------------------------------------

@two_gpus
@nccl
def test_nccl_two_ranks_match_one_rank(one_fused, digits6, tmp_path):
    """torchrun × 2 on CUDA takes NCCL; with the defaults (fused, TF32) every evaluation agrees with
    1 rank within RANK_SAMPLES test samples."""
    two = cuda_run(digits6, tmp_path, ranks=2)
    assert "launcher=torchrun world_size=2 device=cuda:0 backend=nccl" in two.start_line, two.start_line
    assert two.summary["launcher"] == "torchrun"
    assert two.training.startswith("fused ("), two.start_line
    assert_accs_close(two, one_fused, acc_tol(digits6, RANK_SAMPLES), "NCCL x2 vs 1 rank, fused")


@two_gpus
@nccl
def test_nccl_two_ranks_sequential_match_one_rank(one_seq_f32, digits6, tmp_path):
    """With fused=false a client trains alike on any world size and the all-reduce sums in float64:
    1 and 2 ranks on CUDA give the same global state within 1e-5 (float32 convolutions)."""
    two = cuda_run(digits6, tmp_path, "fused=false", ranks=2, env=FLOAT32)
    assert "world_size=2 device=cuda:0 backend=nccl" in two.start_line, two.start_line
    assert two.training == "sequential (fused=false)", two.start_line
    assert_states_close(two.state, one_seq_f32.state, atol=1e-5, label="NCCL x2 vs 1 rank, fused=false:")
    assert_accs_close(two, one_seq_f32, acc_tol(digits6, CLOSE_SAMPLES), "NCCL x2 vs 1 rank, fused=false")


# -- bf16 autocast -----------------------------------------------------------------------------

def test_bf16_autocast_learns_on_cuda(one_fused, digits6, tmp_path):
    """amp=bf16 with the default fused path: finite accuracies, well above chance after 2 rounds and
    within AMP_SAMPLES test samples of float32; the run's config.yaml records amp: bf16."""
    run = cuda_run(digits6, tmp_path, "amp=bf16")
    assert run.training.startswith("fused ("), run.start_line
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["amp"] == "bf16"
    from fedcp_dist.data.shards import read_info

    chance = 1 / read_info(digits6).num_classes
    assert run.accs[-1] > max(chance, run.accs[0]) + 0.3, run.accs
    assert_accs_close(run, one_fused, acc_tol(digits6, AMP_SAMPLES), "amp=bf16 vs float32")


# -- fused group sizing ------------------------------------------------------------------------

def test_fused_groups_sized_on_cuda_match_sequential(one_fused_f32, one_seq_f32, digits6):
    """fused_group=0 on a GPU: the start line says the clients train fused and how the groups are
    sized; the result equals the sequential path's within 5e-4 (float32 convolutions: grouped and
    plain convolutions round differently, and 2 rounds of SGD carry it on; an H200 gave 1.2e-4 on
    2026-12-04; the float64 test above bounds the algorithmic difference at 1e-10)."""
    path = one_fused_f32.training
    assert re.fullmatch(r"fused \(fused=true, [^)]*\bgroups?\b.*\)", path), one_fused_f32.start_line
    assert_states_close(one_fused_f32.state, one_seq_f32.state, atol=5e-4, label="fused vs sequential on CUDA:")
    assert_accs_close(one_fused_f32, one_seq_f32, acc_tol(digits6, CLOSE_SAMPLES), "fused vs sequential on CUDA")


# -- the fused step on the GPU, in-process ---------------------------------------------------------

#: train sizes with B = 10: ragged last batches, fewer than one batch, exact multiples
SIZES = (23, 7, 40, 31, 15, 52, 9, 30)


def _gpu_group(dtype, n_clients: int = len(SIZES)):
    """FedCP (Gumbel noise, MMD, 2 epochs) on the CNN on CUDA in ``dtype``, a moved global state and
    ``n_clients`` random clients of :data:`SIZES` samples: (algo, global state, items)."""
    import numpy as np

    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.algorithms.fedcp import FedCP
    from fedcp_dist.config import Config
    from fedcp_dist.data.resident import to_device
    from fedcp_dist.models import build_model
    from helpers import Data64

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = Config(lr=0.01, batch_size=10, local_epochs=2, lam=5.0, cpn_train_gumbel=True, device="cuda")
    algo = FedCP(cfg, build_model("cnn", (1, 16, 16), 10).to(dtype), dev)
    gs = algo.init_global_state()
    g = torch.Generator().manual_seed(7)
    gs = {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype).to(v.device) for k, v in gs.items()}
    algo.set_global(gs)
    items = []
    for cid, n in enumerate(SIZES[:n_clients]):
        r = np.random.default_rng(100 + cid)
        arrays = {"train_x": r.integers(0, 256, (n, 1, 16, 16), dtype=np.uint8), "train_y": r.integers(0, 10, n),
                  "test_x": r.integers(0, 256, (2, 1, 16, 16), dtype=np.uint8), "test_y": r.integers(0, 10, 2)}
        d = to_device(cid, arrays, (0.5,), (0.5,), dev)
        if dtype == torch.float64:
            d = Data64(**{f: getattr(d, f) for f in d.__dataclass_fields__})
        state = algo.init_client_state(cid)
        state = {**state, "v": state["v"] + 0.1 * cid}
        items.append((state, d, Context(3, cid, torch.Generator(device=dev).manual_seed(11 + cid))))
    return algo, gs, items


def _fresh(items):
    """The same items with each generator re-seeded from its initial seed (a second run's draws)."""
    from fedcp_dist.algorithms.base import Context

    return [(s, d, Context(c.round, c.client, torch.Generator(device=c.generator.device).manual_seed(c.generator.initial_seed())))
            for s, d, c in items]


def test_fused_equals_sequential_in_float64_on_cuda(float64):
    """The fused step's algorithm on the GPU: in float64 every client's upload and state equal its
    sequential ones to 1e-10 (the same batches, Gumbel draws, masks and updates; what float32
    runs add on top is rounding of other kernels)."""
    from fedcp_dist.fused.groups import train_group

    algo, gs, items = _gpu_group(torch.float64)
    fus = train_group(algo, _fresh(items))
    seq = [algo.local_train(*it) for it in _fresh(items)]
    for f, q in zip(fus, seq):
        assert f.samples == q.samples
        assert_states_close(f.upload, q.upload, atol=1e-10, label="fused vs sequential, float64 on CUDA:")
        assert_states_close(f.client_state, q.client_state, atol=1e-10, label="client state:")
    assert max((q.upload[k] - gs[k]).abs().max().item() for q in seq for k in gs) > 1e-3  # training moved it


def test_a_slot_gets_the_same_bits_whatever_the_slots_beside_it():
    """What fused_join=auto rests on: on this GPU, in float32, a client trained in a fused step of 8,
    3 or 1 slots (so beside other clients, or alone, refilled and compacted differently) ends with
    the same bits, so a rank may train all its groups as one set of slots."""
    from fedcp_dist.fused.groups import train_group

    algo, gs, items = _gpu_group(torch.float32)
    runs = {}
    for slots in (8, 3, 1):
        runs[slots] = train_group(algo, _fresh(items), slots=slots)
    for slots in (3, 1):
        for c, (a, b) in enumerate(zip(runs[8], runs[slots])):
            for k in a.upload:
                assert torch.equal(a.upload[k], b.upload[k]), (
                    f"client {c}, {k}: 8 slots vs {slots} differ by {(a.upload[k] - b.upload[k]).abs().max():.3g}")


def test_two_ranks_sharing_one_gpu_match_one_rank(one_fused, digits6, tmp_path):
    """torchrun × 2 on a machine of one GPU: NCCL refuses two ranks on one device, so the ranks take
    gloo over the same CUDA tensors and the start line says why; the fused default's groups are
    fixed by the configuration and trained jointly, so the global state equals 1 rank's bit for bit."""
    if torch.cuda.device_count() > 1:
        pytest.skip("every rank has a GPU of its own here (the NCCL tests cover it)")
    two = cuda_run(digits6, tmp_path, ranks=2)
    assert "world_size=2 device=cuda:0 backend=gloo (2 ranks share 1 GPU: NCCL needs one GPU per rank)" in two.start_line, two.start_line
    for k in one_fused.state:
        assert torch.equal(two.state[k], one_fused.state[k]), f"{k}: 2 ranks on 1 GPU vs 1 rank differ by {(two.state[k] - one_fused.state[k]).abs().max():.3g}"
    assert two.accs == one_fused.accs


def test_a_run_repeats_bit_for_bit(one_fused, digits6, tmp_path):
    """The same configuration on the same GPU twice: the same global state, bit for bit (cuDNN's
    deterministic algorithms; no atomics in the order of additions)."""
    again = cuda_run(digits6, tmp_path)
    for k in one_fused.state:
        assert torch.equal(again.state[k], one_fused.state[k]), f"{k} differs by {(again.state[k] - one_fused.state[k]).abs().max():.3g}"


# -- a dead rank -------------------------------------------------------------------------------

def _metric_lines(out: Path) -> int:
    p = out / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def _wait_rounds(out: Path, proc, n: int, timeout: float = 300) -> None:
    t0 = time.time()
    while _metric_lines(out) < n:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() - t0 < timeout, f"{n} metric lines did not appear in {out}"
        time.sleep(0.05)


def _rank_pids(launcher_pid: int) -> dict:
    """{rank: pid} of the fedcp_dist.run processes under ``launcher_pid``, by their RANK variable."""
    ranks = {}
    for pid in descendants(launcher_pid)[1:]:
        try:
            if b"fedcp_dist.run" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = pid
    return ranks


def _gone(pid: int) -> bool:
    """True when ``pid`` has ended (a zombie nobody reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


#: the survivor's own one-line error (as on gloo: tests/test_failures.py)
SURVIVOR_LINE = re.compile(r"^error: rank 0, [^\n]*a collective failed: rank\(s\) 1 stopped answering", re.M)


@two_gpus
@nccl
def test_dead_rank_under_torchrun_with_nccl(digits6, tmp_path):
    """Rank 1 SIGKILLed mid-run under torchrun on NCCL: the job exits non-zero within
    collective_timeout plus torchrun's grace, rank 0 is gone, and the output names rank 1 as the
    dead one: rank 0's own error line, or torchrun's report of rank 1 ended by signal 9. (NCCL
    collectives are asynchronous: a rank blocked on one answers neither SIGTERM nor, before
    collective_timeout, a Python exception.)"""
    proc = start([*_torchrun(2), "-m", "fedcp_dist.run",
                  *_args(digits6, tmp_path, "rounds=500", f"collective_timeout={DEAD_TIMEOUT}")])
    try:
        _wait_rounds(tmp_path, proc, 3)
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.time()
        out, _ = proc.communicate(timeout=DEAD_TIMEOUT + DEAD_GRACE + 60)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert "backend=nccl" in out, out[-3000:]
    assert proc.returncode != 0 and elapsed < DEAD_TIMEOUT + DEAD_GRACE, (proc.returncode, elapsed, out[-3000:])
    assert _gone(ranks[0]), f"rank 0 (pid {ranks[0]}) still runs after torchrun ended"
    by_torchrun = re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9\b", out)
    assert SURVIVOR_LINE.search(out) or by_torchrun, out[-3000:]


@two_gpus
@nccl
def test_dead_rank_without_a_launcher_with_nccl(digits6, tmp_path):
    """Two ranks rendezvous by themselves on NCCL (no torchrun agent to end the survivor): when rank 1
    is SIGKILLed, rank 0 must end on its own, non-zero, within collective_timeout plus a grace,
    and say why: its own error line naming rank 1, or NCCL's watchdog naming the collective that
    timed out after collective_timeout (the process group's timeout is the config's)."""
    envs = rank_envs()
    procs = []
    try:
        for rank in (0, 1):
            env = envs[rank]
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fedcp_dist.run",
                 *_args(digits6, tmp_path, "rounds=500", f"collective_timeout={DEAD_TIMEOUT}")],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        _wait_rounds(tmp_path, procs[0], 3)
        procs[1].kill()
        t0 = time.time()
        out, _ = procs[0].communicate(timeout=DEAD_TIMEOUT + DEAD_GRACE + 60)
        elapsed = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert "backend=nccl" in out, out[-3000:]
    assert procs[0].returncode != 0 and elapsed < DEAD_TIMEOUT + DEAD_GRACE, (procs[0].returncode, elapsed,
                                                                              out[-3000:])
    by_watchdog = re.search(rf"collective operation timeout: WorkNCCL\([^)]*Timeout\(ms\)={DEAD_TIMEOUT * 1000}\b", out)
    assert SURVIVOR_LINE.search(out) or by_watchdog, out[-3000:]
