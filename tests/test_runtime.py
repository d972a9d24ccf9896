"""The runtime: which launcher started the process and the SLURM endpoints, the stop signals,
and keep_freed_memory's allocator thresholds."""
import os
import signal
import subprocess

import pytest
import torch

from fedcp_dist.errors import UserError
from fedcp_dist.rundir.preemption import StopSignals
from fedcp_dist.runtime import Endpoint, detect_launcher, expand_nodelist, resolve_endpoint, tasks_per_node


def test_launcher_detection():
    assert detect_launcher({}) == "single"
    assert detect_launcher({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == "torchrun"
    assert detect_launcher({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert detect_launcher({"PMI_SIZE": "4"}) == "mpi"
    assert detect_launcher({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4"}) == "slurm"
    # inside an sbatch script but not in an srun step: one rank
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) == "single"
    assert detect_launcher({"FEDCP_LAUNCHER": "single", "OMPI_COMM_WORLD_SIZE": "1"}) == "single"
    assert detect_launcher({"FEDCP_LAUNCHER": "single", "SLURM_STEP_ID": "batch", "SLURM_STEP_NUM_TASKS": "2"}) == "single"
    with pytest.raises(UserError):
        detect_launcher({"FEDCP_LAUNCHER": "pbs"})


@pytest.mark.parametrize("env", [{"OMPI_COMM_WORLD_SIZE": "2"}, {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"},
                                 {"PMI_SIZE": "4"}])
def test_a_forced_single_launcher_under_a_launchers_copies_is_refused(env):
    """``FEDCP_LAUNCHER=single`` in an ``srun -n 2`` step (or under mpirun -n 2): each copy ran the
    whole run alone, the second was refused by the first's out_dir lock, and srun's
    --kill-on-bad-exit then stopped the first, which checkpointed: the job requeued itself once a
    round and ended COMPLETED with one rank."""
    with pytest.raises(UserError, match=r"^FEDCP_LAUNCHER=single but a launcher started [24] copies of this process "
                                        r"\(.*\): each would run the whole run alone; unset FEDCP_LAUNCHER"):
        detect_launcher({"FEDCP_LAUNCHER": "single", **env})


def test_slurm_endpoint():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_NODELIST": "gpu[007-009,012]",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    }
    ep = resolve_endpoint("slurm", env)
    assert ep == Endpoint(5, 8, 1, 4, f"tcp://gpu007:{20000 + 123456 % 20000}")
    assert expand_nodelist("node1,node2") == ["node1", "node2"]
    assert expand_nodelist("a-b[1-2]") == ["a-b1", "a-b2"]


def test_the_slurm_port_differs_between_the_steps_of_a_job_and_between_consecutive_jobs():
    from fedcp_dist.runtime import slurm_port

    ports = {slurm_port({"SLURM_JOB_ID": str(j), "SLURM_STEP_ID": str(s)}) for j in range(1000, 1100) for s in range(3)}
    assert len(ports) == 300 and min(ports) >= 20000 and max(ports) < 32000  # below the ports of outgoing connections
    assert slurm_port({"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "1"}) == 20000 + (123456 + 997) % 12000
    assert slurm_port({}) == 20000 and slurm_port({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "batch"}) == 20007


def test_the_cores_of_a_slurm_job_are_its_cpus_on_the_node(monkeypatch):
    """A cluster that does not pin tasks (task/none) leaves every core in the affinity: a 1-CPU array
    task ran as many threads as the node has cores."""
    import os

    from fedcp_dist.runtime import _cpu_count

    every = len(os.sched_getaffinity(0))
    assert _cpu_count({}) == every
    assert _cpu_count({"SLURM_CPUS_ON_NODE": "1"}) == 1
    assert _cpu_count({"SLURM_CPUS_ON_NODE": str(every + 8)}) == every
    assert _cpu_count({"SLURM_CPUS_ON_NODE": "x"}) == every


def test_a_stop_signal_before_the_runtime_names_the_launchers_rank(monkeypatch):
    """Both ranks of a job signalled during start-up said 'rank 0: got SIGUSR2'."""
    from fedcp_dist.rundir.preemption import StopSignals

    monkeypatch.setenv("SLURM_PROCID", "3")
    assert StopSignals().rank == 3 and StopSignals(rank=1).rank == 1
    monkeypatch.delenv("SLURM_PROCID")
    for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert StopSignals().rank == 0


def test_slurm_node_lists_and_tasks_per_node():
    assert expand_nodelist("gpu[007-009,012],cpu1") == ["gpu007", "gpu008", "gpu009", "gpu012", "cpu1"]
    assert expand_nodelist("n[9-11]") == ["n9", "n10", "n11"]
    assert expand_nodelist("localhost") == ["localhost"]
    with pytest.raises(UserError, match="cannot read the SLURM node list"):
        expand_nodelist("n[a-b]")
    assert tasks_per_node("4(x2),3") == [4, 4, 3]
    assert tasks_per_node("2") == [2]
    assert tasks_per_node("") == [1]


def test_slurm_endpoint_is_per_node(monkeypatch):
    """Two nodes with 4 and 3 tasks: the local world (threads = cores / local world, device =
    local rank) is the task's own node's, the master the first node of the list."""
    import fedcp_dist.runtime as runtime

    monkeypatch.setattr(runtime.shutil, "which", lambda name: None)  # the documented fallback parser
    env = {"SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_NODELIST": "cn[03-04]", "SLURM_JOB_ID": "41",
           "SLURM_STEP_TASKS_PER_NODE": "4,3"}
    on_second = resolve_endpoint("slurm", {**env, "SLURM_PROCID": "6", "SLURM_NODEID": "1", "SLURM_LOCALID": "2"})
    assert on_second == Endpoint(6, 7, 2, 3, "tcp://cn03:20041")
    on_first = resolve_endpoint("slurm", {**env, "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "1"})
    assert on_first == Endpoint(1, 7, 1, 4, "tcp://cn03:20041")
    # scontrol, where it answers, names the hosts
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="alpha\nbeta\n", stderr="")

    monkeypatch.setattr(runtime.shutil, "which", lambda name: "/usr/bin/scontrol")
    monkeypatch.setattr(runtime.subprocess, "run", fake_run)
    assert resolve_endpoint("slurm", {**env, "SLURM_PROCID": "0"}).init_method == "tcp://alpha:20041"
    assert calls == [["/usr/bin/scontrol", "show", "hostnames", "cn[03-04]"]]
    # an scontrol that cannot answer (no slurm.conf here) falls back to the parser
    monkeypatch.setattr(runtime.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="fatal"))
    assert resolve_endpoint("slurm", {**env, "SLURM_PROCID": "0"}).init_method == "tcp://cn03:20041"


def test_stop_signals_are_noted_then_restored():
    before = signal.getsignal(signal.SIGUSR2)
    hup_before = signal.getsignal(signal.SIGHUP)  # SIG_IGN under nohup, SIG_DFL otherwise
    with StopSignals(0, ("SIGUSR2", "SIGTERM")) as stop:
        assert stop.signum is None
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.signum == signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not replace the first
        assert stop.signum == signal.SIGUSR2
        with stop:  # entered again (the run inside fedcp-run's own listening): nothing changes
            assert signal.getsignal(signal.SIGUSR2) == stop._note
        assert signal.getsignal(signal.SIGUSR2) == stop._note
        stop.listen(("SIGTERM", "SIGHUP"))  # the config's preempt_signal: SIGUSR2 is given back
        assert signal.getsignal(signal.SIGUSR2) == before and signal.getsignal(signal.SIGHUP) == stop._note
        assert stop.signum == signal.SIGUSR2  # what was noted stays noted
    assert signal.getsignal(signal.SIGUSR2) == before and signal.getsignal(signal.SIGHUP) == hup_before


def test_keep_freed_memory_sets_both_thresholds_on_a_cpu_device():
    from fedcp_dist import runtime

    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 1

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert runtime.keep_freed_memory("auto", cpu, mallopt) == "on"
    assert calls == [(-3, 1 << 30), (-1, 2**31 - 1)]  # M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD the largest int
    calls.clear()
    assert runtime.keep_freed_memory("auto", cuda, mallopt) == "off" and calls == []  # a GPU rank: left alone
    assert runtime.keep_freed_memory(False, cpu, mallopt) == "off" and calls == []
    assert runtime.keep_freed_memory(True, cuda, mallopt) == "on" and len(calls) == 2


def test_keep_freed_memory_falls_back_to_32_mib_or_says_it_could_not():
    from fedcp_dist import runtime

    calls = []

    def only_32_mib(param, value):  # a glibc whose mmap threshold stops at 32 MiB
        calls.append((param, value))
        return 1 if param == -1 or value <= 32 << 20 else 0

    assert runtime.keep_freed_memory(True, torch.device("cpu"), only_32_mib) == "on"
    assert calls == [(-3, 1 << 30), (-3, 32 << 20), (-1, 2**31 - 1)]
    assert runtime.keep_freed_memory(True, torch.device("cpu"), lambda p, v: 0) == "unavailable (mallopt refused)"


_KEPT = """
import sys, torch
from fedcp_dist.runtime import keep_freed_memory
print(keep_freed_memory(sys.argv[1] == "true", torch.device("cpu")))
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
returned = []
for _ in range(3):
    t = torch.zeros(16 << 20)  # 64 MiB, every page touched
    held = rss()
    del t
    returned.append(held - rss())
print(*returned)
"""


def test_keep_freed_memory_keeps_a_freed_block_in_the_process():
    """The real allocator: freeing a 64 MiB tensor returns its pages to the system without
    keep_freed_memory (glibc unmaps it: the next one faults all 16,384 pages in again) and keeps
    them in the process with it. Whether a later block reuses them at once depends on what fits
    where in the heap; docs/performance.md shows the effect on evaluation and training."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc/self/statm to read the resident size from")
    import sys

    out = {}
    for setting in ("true", "false"):
        r = subprocess.run([sys.executable, "-c", _KEPT, setting], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        state, *returned = r.stdout.split()
        assert state == ("on" if setting == "true" else "off")
        out[setting] = [float(v) for v in returned]
    assert all(v >= 63 for v in out["false"])  # each 64 MiB block went back to the system
    assert all(v <= 1 for v in out["true"])  # and stayed with keep_freed_memory


def test_a_process_group_that_cannot_open_is_one_line_per_rank(digits6, tmp_path):
    """Two ranks that meet (the rendezvous store answers) but cannot open gloo's group, here a
    network interface that does not exist (GLOO_SOCKET_IFNAME, a common cluster setting): each rank
    stops in one line naming the backend's reason and the variable, exit 1, nothing written."""
    import sys

    from helpers import rank_envs, run_hand_ranks

    cmd = [sys.executable, "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml", f"data.path={digits6}",
           f"out_dir={tmp_path / 'run'}", "rounds=1", "threads=1"]
    done = run_hand_ranks([cmd, cmd], [dict(env, GLOO_SOCKET_IFNAME="nonexist0") for env in rank_envs()])
    errs = [err for _, _, err in done]
    assert [rc for rc, _, _ in done] == [1, 1], errs
    for rank, err in enumerate(errs):
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert "Traceback" not in err and lines == [
            f"error: rank {rank}: the ranks met but could not open their gloo process group (ifa != nullptr. Unable to "
            "find address for: nonexist0): GLOO_SOCKET_IFNAME=nonexist0 names the network interface to use: check that "
            "it exists on every node"], err[-2000:]
    assert not (tmp_path / "run").exists()


def test_process_group_failure_hints():
    from fedcp_dist.runtime import process_group_failure

    exc = RuntimeError("[enforce fail at ../gloo/transport/tcp/device.cc:189] rv != -1. Too many open files\nstack")
    assert process_group_failure(1, "gloo", exc, {}) == (
        "rank 1: the ranks met but could not open their gloo process group (rv != -1. Too many open files): the "
        "open-file limit (ulimit -n) is too low for the ranks' connections: raise it")
    assert process_group_failure(0, "nccl", RuntimeError("NCCL error: unhandled system error"), {}) == (
        "rank 0: the ranks met but could not open their nccl process group (NCCL error: unhandled system error): a "
        "rank that stopped or died while the group opened (its own line, if any, is in its log), a network the ranks "
        "cannot reach each other on, or a firewall between nodes")


def test_stderr_held_drops_torchs_cpp_lines_and_keeps_the_rest(capfd):
    """What C++ code writes to file descriptor 2 inside the block: torch's log lines and stack
    traces (with or without the "[rank N]:" torch puts before them) are dropped, other lines kept;
    with a predicate that drops every line the block is silent."""
    from fedcp_dist.launch_env import stderr_held

    lines = ["[W1205 10:01:02.000000000 TCPStore.cpp:106] [c10d] sendBytes failed\n",
             "[rank1]:[W1205 10:01:02.000 socket.cpp:464] [c10d] connect failed\n",
             "Exception raised from recvBytes at torch/csrc/distributed/c10d/Utils.hpp:671\n",
             "frame #0: c10::Error::Error + 0x98\n", "[rank3]:frame #1: <unknown function>\n",
             "UserWarning: something a user should see\n"]
    capfd.readouterr()
    with stderr_held():
        os.write(2, "".join(lines).encode())
    assert capfd.readouterr().err == "UserWarning: something a user should see\n"
    with stderr_held(lambda line: True):
        os.write(2, "".join(lines).encode())
    assert capfd.readouterr().err == ""
