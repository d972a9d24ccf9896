"""Memory: a fused step's rows follow the data, not batch_size; the estimate of a run's peak
(hand-computed figures, a CPU and a GPU with made-up device memory); the limits it reads (cgroup
files, RLIMIT_AS); and real runs under an address-space cap (RLIMIT_AS), which must end in the
one-line refusal naming a key that fits, run with that key, and run under a cap just above the
estimate."""
from __future__ import annotations

import dataclasses
import json
import re
import resource
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from fedcp_dist.fused import slots as fused
from fedcp_dist.engine import preflight
from fedcp_dist.errors import UserError
from fedcp_dist.engine.preflight import MARGIN_BYTES, Figures, Free, MiB, estimate

GiB = 2**30


def cpu_figures(**kw) -> Figures:
    base = dict(device="cpu", now=100 * MiB, now_host=100 * MiB, owned=4, held=MiB, per_client=MiB, store="device",
                in_flight=6, global_bytes=2 * MiB, upload_elements=2**18, batch_size=10, max_train=50,
                eval_batch_size=100, max_test=20, act_train=1000, act_eval=500)
    base.update(kw)
    return Figures(**base)


def fused_figures(**kw) -> Figures:
    base = dict(fused=True, slot_params=3 * MiB, per_result=MiB, slot_cap=8, slot_budget=GiB, group_clients=5,
                groups=2, workers=2, side_budget=GiB, batch_size=100000)
    base.update(kw)
    return cpu_figures(**base)


def test_fused_rows_follow_the_largest_client_not_batch_size():
    assert fused.batch_rows(100000, [33, 140, 0]) == 140
    assert fused.batch_rows(10, [33, 140]) == 10
    assert fused.batch_rows(10, []) == 1


def test_the_estimate_one_client_at_a_time_by_hand():
    items = estimate(cpu_figures())["device"]
    states = 2 * 4 * MiB - MiB  # 4 clients of 1 MiB, twice (old and new), 1 MiB held already
    train = 2 * 4 * 10 * 1000 + 3 * 2 * MiB + 2 * MiB  # activations (2 copies, 4 bytes, 10 rows), 3 globals, 2 states
    evaluation = 4 * 20 * 500 + 2 * MiB  # 20 test rows (the largest client's), a global state
    round_ = 2 * 8 * 2**18 + 2 * MiB  # the float64 mean twice, a global state
    assert train > max(evaluation, round_)
    assert items == {"client states": states, "training": train, "peer exchange": 0, "checkpoint": 0,
                     "margin": int(0.15 * (states + train)) + MARGIN_BYTES}
    # a loop of its own (FedRep's features): a pass without gradient over 50 training rows besides;
    # a peer method's other models and all-gather
    other = estimate(cpu_figures(own_loop=True, peer_bytes=5 * MiB))["device"]
    assert other["training"] == train + 4 * 50 * 500 and other["peer exchange"] == 5 * MiB
    # dp=central: an upload's float32 delta while it is clipped; the round's float64 noise
    dp = estimate(cpu_figures(dp=True))["device"]
    assert dp["training"] == train + 4 * 2**18
    big = cpu_figures(dp=True, upload_elements=2**22)  # an upload whose round outweighs the training
    assert estimate(big)["device"]["training"] == 3 * 8 * 2**22 + 2 * MiB
    # a disk store keeps the clients in flight only (read ahead, recent: all 4 here), and maps them to checkpoint
    disk = cpu_figures(store="disk", held=0)
    assert estimate(disk)["device"]["client states"] == 4 * MiB and preflight.mapped_bytes(disk) == 4 * MiB


def test_the_estimate_of_fused_groups_by_hand():
    f = fused_figures()
    assert f.rows() == 50  # batch_size 100000, the largest client 50 samples
    per_slot = 3 * MiB + 2 * 4 * 50 * 1000
    assert f.slots() == 5  # the group's 5 clients, under the cap of 8 and the budget
    one = 5 * per_slot + 2 * 5 * MiB  # the slots, the group's results and their starting values
    assert preflight.training_bytes(f)[0] == 2 * one  # two groups side by side
    assert preflight.training_bytes(dataclasses.replace(f, side_budget=one + 1))[0] == one  # room for one
    # two phases (Ditto's): a group holds both phases' starting values and outcomes, 7 MiB a client
    assert preflight.training_bytes(dataclasses.replace(f, group_per_client=7 * MiB))[0] == \
        2 * (5 * per_slot + 5 * 7 * MiB)
    assert dataclasses.replace(f, slot_budget=2 * (per_slot + MiB)).slots() == 2  # as group_slots sizes them
    assert dataclasses.replace(f, fused_group=2).slots() == 2
    assert f.threads_to_start() == 2 and dataclasses.replace(f, store="disk").threads_to_start() == 3
    assert dataclasses.replace(f, batch_size=50) == dataclasses.replace(f, batch_size=50)
    assert estimate(dataclasses.replace(f, batch_size=50)) == estimate(f)  # rows, not batch_size


def test_address_space_limits_count_threads_mapped_files_and_slack():
    need = 100 * MiB
    assert Free.counted("available memory", need, threads=2, mapped=MiB) == need
    assert Free.counted("RLIMIT_AS", need, threads=2, mapped=MiB) == \
        need + 2 * preflight.THREAD_ADDRESS_SPACE + MiB + preflight.ADDRESS_SLACK
    free = Free([("available memory", GiB), ("RLIMIT_AS", need + preflight.ADDRESS_SLACK)])
    assert free.tightest(need) is None
    assert free.tightest(need, threads=1)[0] == "RLIMIT_AS"


def test_a_run_that_does_not_fit_is_refused_naming_a_key_that_fits():
    f = fused_figures()
    need = sum(estimate(f)["device"].values())
    smaller = sum(estimate(dataclasses.replace(f, fused_group=2))["device"].values())
    assert smaller < need
    # room for groups of 2 but not of 5 (nor of the client store on disk, which saves nothing here)
    free = {"device": Free([("available memory", smaller + MiB)])}
    with pytest.raises(UserError) as exc:
        preflight.check(f, free, rank=3)
    msg = str(exc.value)
    assert msg.startswith("config key 'fused_group': rank 3 needs about") and msg.endswith("fused_group=2 fits")
    assert "host memory" in msg and "(available memory)" in msg and "\n" not in msg
    # with room for nothing: one line that says so
    with pytest.raises(UserError, match=r"^not enough memory: .* use more ranks"):
        preflight.check(f, {"device": Free([("available memory", MiB)])}, rank=0)
    # with room: the line that says the estimate
    line = preflight.check(f, {"device": Free([("available memory", 10 * GiB)])}, rank=0)
    assert line.startswith(f"memory on rank 0: host about {preflight.mib(100 * MiB + need)} at the peak (100 MiB now")


def test_gpu_figures_put_the_states_on_the_device_and_the_checkpoint_on_the_host():
    """A GPU with made-up memory: 1000 clients of 10 MiB kept on a 12 GiB-free device do not fit;
    client_state=host does (the states in flight on the device, the rest in host memory)."""
    f = cpu_figures(device="cuda", now=GiB, now_host=2 * GiB, owned=1000, held=0, per_client=10 * MiB,
                    max_train=500, batch_size=64)
    pools = estimate(f)
    assert pools["device"]["client states"] == 2 * 1000 * 10 * MiB
    assert pools["host"]["checkpoint"] == 1000 * 10 * MiB + 2 * MiB  # copied to the host to be written
    host = dataclasses.replace(f, store="host")
    assert estimate(host)["device"]["client states"] == 7 * 10 * MiB  # 6 in flight and the one training
    assert estimate(host)["host"]["client states"] == 2 * 1000 * 10 * MiB
    free = {"device": Free([("the GPU's free memory", 12 * GiB)]), "host": Free([("available memory", 64 * GiB)])}
    with pytest.raises(UserError, match=r"^config key 'client_state': rank 0 needs about 22\.5 GiB more GPU memory "
                                        r"for its rounds \(client states 19\.5 GiB, .*are left \(the GPU's free "
                                        r"memory\); client_state=host fits$"):
        preflight.check(f, free, rank=0)
    # the host too small for the states as well: on disk
    free["host"] = Free([("available memory", 4 * GiB)])
    with pytest.raises(UserError, match=r"client_state=disk fits$"):
        preflight.check(f, free, rank=0)
    line = preflight.check(host, {"device": Free([("the GPU's free memory", 8 * GiB)]),
                                  "host": Free([("available memory", 64 * GiB)])}, rank=0)
    assert line.startswith("memory on rank 0: GPU about 1.1 GiB at the peak (1.0 GiB now + client states 70 MiB, ")
    assert "; host about 24.5 GiB at the peak (2.0 GiB now + client states 19.5 GiB, margin 3.0 GiB)" in line


def test_free_memory_of_a_gpu_reads_the_device(monkeypatch):
    from fedcp_dist.fused import memory as fused_memory

    monkeypatch.setattr(fused_memory, "available_memory", lambda device: 5 * GiB)
    free = preflight.free_memory("cuda:0")
    assert free["device"].limits == [("the GPU's free memory", 5 * GiB)] and free["host"].limits[0][0] == "available memory"


def test_cgroup_limits_v1_and_v2(tmp_path):
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    # v2: the group and its parent; the parent's limit is the tighter; dropped page cache does not count
    proc.write_text("0::/jobs/job1\n")
    for d, limit, usage, cache in ((root / "jobs", 3 * GiB, 2 * GiB, 0), (root / "jobs" / "job1", "max", GiB, GiB // 2)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"anon 1\ninactive_file {cache}\n")
    assert preflight.cgroup_left(str(root), str(proc)) == GiB
    (root / "jobs" / "job1" / "memory.max").write_text(f"{GiB}\n")
    assert preflight.cgroup_left(str(root), str(proc)) == GiB - (GiB - GiB // 2)
    # v1
    proc.write_text("4:memory:/a\n2:cpu:/a\n")
    d = root / "memory" / "a"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    (d / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    (d / "memory.stat").write_text(f"total_inactive_file {GiB}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")  # no limit at the top
    (root / "memory" / "memory.usage_in_bytes").write_text("5\n")
    assert preflight.cgroup_left(str(root), str(proc)) == 4 * GiB
    proc.write_text("2:cpu:/a\n")
    assert preflight.cgroup_left(str(root), str(proc)) is None


def test_host_limits_include_rlimit_as_when_set():
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    huge = 1 << 46  # far above anything this process maps: setting it changes nothing but the figure
    resource.setrlimit(resource.RLIMIT_AS, (huge, hard))
    try:
        limits = dict(preflight.host_free().limits)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert huge - 64 * GiB < limits["RLIMIT_AS"] < huge and limits["available memory"] > 0


def test_data_that_cannot_fit_is_refused_before_it_is_read(digits6_16px, tmp_path, capsys, monkeypatch):
    from fedcp_dist.run import main

    monkeypatch.setattr(preflight, "host_free", lambda: Free([("cgroup memory limit", 100_000)]))
    with pytest.raises(SystemExit) as exc:
        # client_data=resident: auto would read such data on demand instead (and the rounds' own
        # pre-flight refuse the run)
        main(["--config", "configs/digits_fedcp.yaml", f"data.path={digits6_16px}", f"out_dir={tmp_path}",
              "rounds=1", "threads=1", "client_data=resident"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    # 1797 samples of 16 x 16 uint8 pixels and an int64 label each
    assert err.startswith(f"error: not enough memory: rank 0's 6 clients hold {preflight.mib(1797 * (256 + 8))} of "
                          f"data (in host memory) but 0.1 MiB are left (cgroup memory limit)"), err


def test_data_that_fits_but_not_the_address_space_reading_maps_names_the_limit(digits6_16px, tmp_path, capsys,
                                                                                 monkeypatch):
    """Under ``ulimit -v`` with a few MiB left, the refusal said the data needed 1.4 MiB and 8.9 MiB
    were left, and to use more ranks: it compares the address space that reading maps, which it now
    names, with the advice to raise the limit."""
    from fedcp_dist.run import main

    data = 1797 * (256 + 8)
    monkeypatch.setattr(preflight, "host_free", lambda: Free([("RLIMIT_AS", 4 * data)]))
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/digits_fedcp.yaml", f"data.path={digits6_16px}", f"out_dir={tmp_path}",
              "rounds=1", "threads=1", "client_data=resident"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    counted = preflight.mib(Free.counted("RLIMIT_AS", data))
    assert err == (f"error: not enough memory: rank 0's 6 clients hold {preflight.mib(data)} of data (in host memory, "
                   f"{counted} of address space with what reading it maps beyond what it touches) but "
                   f"{preflight.mib(4 * data)} are left (RLIMIT_AS); raise or unset RLIMIT_AS (ulimit -v)\n"), err


def test_batch_size_beyond_the_data_gives_the_same_fused_run_and_says_its_memory(digits6_16px, tmp_path):
    """batch_size=100000 on clients of at most a few hundred samples trains exactly as batch_size =
    the largest client's samples (it padded every step to 100000 rows before, tens of GB)."""
    from fedcp_dist.data.shards import read_info
    from helpers import run

    largest = int(read_info(digits6_16px).train_counts.max())
    said = {}
    for b in (largest, 100000):
        lines = []
        run("configs/digits_fedcp.yaml", [f"data.path={digits6_16px}", f"out_dir={tmp_path / str(b)}", "rounds=1",
                                          "fused=true", "threads=1", f"batch_size={b}"], echo=lines.append)
        said[b] = [line for line in lines if line.startswith("memory on rank 0: host about ")]
    a, b = (torch.load(tmp_path / str(x) / "final_global.pt", weights_only=True) for x in (largest, 100000))
    assert all(torch.equal(a[k], b[k]) for k in a)
    to_come = {b: lines[0].split("now + ")[1].split(")")[0] for b, lines in said.items()}
    assert len(said[100000]) == 1 and to_come[100000] == to_come[largest], said


# --------------------------------------------------------------------------- under a real memory cap


def _capped(cap_mib: int, shard, out, *extra) -> subprocess.CompletedProcess:
    """fedcp-run with its address space capped at ``cap_mib`` MiB (RLIMIT_AS)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap_mib * MiB, resource.RLIM_INFINITY))

    return subprocess.run([sys.executable, "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml",
                           f"data.path={shard}", f"out_dir={out}", "rounds=1", "threads=1", "batch_size=100000",
                           *extra], cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=limit,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_under_an_address_space_cap_a_run_is_refused_in_one_line_or_runs(digits6_16px, tmp_path):
    """The address space a run will need, from its own line under a far cap; then, capped half-way
    to it: one line naming a key and a value (no allocator traceback, no kill), and that value runs
    under the same cap; capped just above it, the run itself runs (the estimate holds)."""
    first = _capped(65536, digits6_16px, tmp_path / "first")
    assert first.returncode == 0, first.stderr[-2000:]
    need, left = map(int, re.search(r"RLIMIT_AS: (\d+) of (\d+) MiB left", first.stdout).groups())
    now = 65536 - left  # the address space in use when the estimate was made
    tight = now + need // 2
    refused = _capped(tight, digits6_16px, tmp_path / "refused")
    err = refused.stderr
    assert refused.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    m = re.fullmatch(r"error: config key '(\w+)': rank 0 needs about .* are left \(RLIMIT_AS\); (\w+)=(\w+) fits\n", err)
    assert m and m.group(1) == m.group(2), err
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    advised = _capped(tight, digits6_16px, tmp_path / "advised", f"{m.group(2)}={m.group(3)}")
    assert advised.returncode == 0, advised.stderr[-2000:]
    just_above = _capped(now + need + 16, digits6_16px, tmp_path / "above")
    assert just_above.returncode == 0, just_above.stderr[-2000:]
    assert json.loads((tmp_path / "above" / "summary.json").read_text())["rounds"] == 1


def test_an_address_space_limit_too_low_to_load_torch_is_one_line_before_torch_loads(digits6_16px, tmp_path):
    """Under 3.25 GiB of address space the imports of torch's libraries abort or hang (measured);
    the run checks the limit before it imports them: one line, exit 2, nothing written."""
    from fedcp_dist import errors

    r = _capped(2048, digits6_16px, tmp_path / "run")
    assert r.returncode == 2 and r.stderr == (
        "error: the address-space limit (ulimit -v) is 2,048 MiB; loading torch and its libraries needs more than "
        f"{errors.ADDRESS_SPACE_FLOOR / GiB:g} GiB of address space before anything is trained (address space, not "
        "memory): raise or unset the limit (SLURM's VSizeFactor, SGE's h_vmem set it)\n"), r.stderr
    assert not (tmp_path / "run").exists()


def test_a_failed_import_under_an_address_space_limit_is_one_line(monkeypatch, capsys):
    from fedcp_dist import errors

    @errors.cli_main
    def tool():
        raise ImportError("libtorch_cpu.so: failed to map segment from shared object")

    monkeypatch.setattr(errors, "address_space_limit", lambda: 3400 * MiB)
    with pytest.raises(SystemExit) as exc:
        tool()
    assert exc.value.code == 1 and capsys.readouterr().err == (
        "error: ImportError under an address-space limit of 3,400 MiB (ulimit -v): libtorch_cpu.so: failed to map "
        "segment from shared object; raise or unset the limit (it counts the libraries torch maps, not memory used)\n")
    monkeypatch.setattr(errors, "address_space_limit", lambda: None)  # no limit: a real import error, as it is
    with pytest.raises(ImportError):
        tool()


def test_a_small_cohort_is_charged_its_participants_not_its_groups_clients():
    """At 1 % participation a fused group holds about 800 clients and the peer methods' ranks hold
    thousands, of which a round trains a handful: the memory estimate charged a group's every
    client (FEMNIST-sized data at ρ = 0.003 was refused for 33 GiB and peaked under 1 GiB), and the
    peer exchange's buffer every client of the fullest rank. Both count at most the largest
    cohort now; the groups of a rank that trains them jointly (a GPU) count together."""
    from types import SimpleNamespace

    import numpy as np

    from fedcp_dist.config import Config

    groups = [list(range(800)), list(range(800, 1500))]
    cpu = Config().validate(data_file=False)
    small, whole = SimpleNamespace(max_cohort=10), SimpleNamespace(max_cohort=0)
    assert preflight.group_participants(cpu, "cpu", small, groups) == 10
    assert preflight.group_participants(cpu, "cpu", whole, groups) == 800
    joint = Config(fused_join=True).validate(data_file=False)
    assert preflight.group_participants(joint, "cpu", whole, groups) == 1500
    assert preflight.group_participants(joint, "cpu", SimpleNamespace(max_cohort=1200), groups) == 1200
    ranks = SimpleNamespace(max_cohort=36, clients_per_rank=lambda w: np.array([1799, 1798]))
    assert preflight.peer_rows(ranks, 2) == 36
    assert preflight.peer_rows(SimpleNamespace(max_cohort=0, clients_per_rank=lambda w: np.array([5, 4])), 2) == 5
