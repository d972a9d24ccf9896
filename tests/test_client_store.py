"""Where clients' states live between rounds (client_state: device | host | disk | auto): the
stores give the same runs, bit for bit, and a disk store resumes from checkpoints exactly."""
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import run_cmd
from helpers import PreemptAt, run
from fedcp_dist.config import merged_overrides
from fedcp_dist.errors import RunFailure
from fedcp_dist.rundir.checkpoint import Checkpointer
from fedcp_dist.state.client_store import ClientStore, resolve_mode
from fedcp_dist.state.disk_store import DiskClientStore
from fedcp_dist.errors import Preempted

MiB = 2**20


def _ditto(shard, out, *extra):
    return merged_overrides([f"data.path={shard}", f"out_dir={out}", "rounds=3", "eval_every=2", "participation=0.5",
                             "checkpoint_every=1", "threads=1",
                             "fused=false"], extra)  # one client at a time: PreemptAt wraps local_train


def _records(out: Path):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def _final(out: Path):
    ck = Checkpointer(str(out), 0, 1, 1)
    _, g, clients, _ = ck.load(ck.latest(), range(100), "cpu")
    return g, clients


@pytest.fixture(scope="module")
def device_run(digits6, tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    run("configs/digits_ditto.yaml", _ditto(digits6, out))
    return out


def _same(a: Path, b: Path):
    assert _records(a) == _records(b)
    (ga, ca), (gb, cb) = _final(a), _final(b)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
    # the device store also checkpoints the initial states of clients it only evaluated;
    # a disk store keeps (and checkpoints) only the states of clients that trained
    assert set(cb) <= set(ca) and cb
    for c in cb:
        assert cb[c].keys() == ca[c].keys() and all(torch.equal(ca[c][k], cb[c][k]) for k in ca[c])
    return cb


def test_disk_and_host_stores_give_the_device_stores_run_bit_for_bit(digits6, device_run, tmp_path):
    disk = tmp_path / "disk"
    lines = []
    run("configs/digits_ditto.yaml", _ditto(digits6, disk, "client_state=disk"), echo=lines.append)
    trained = _same(device_run, disk)
    files = sorted(p.name for p in (disk / "client_state" / "rank_0").glob("*.pt"))
    assert files == [f"client_{c:07d}.pt" for c in sorted(trained)]
    assert "client states: disk (" in lines[0]
    host = tmp_path / "host"
    run("configs/digits_ditto.yaml", _ditto(digits6, host, "client_state=host"))
    _same(device_run, host)


def test_disk_store_resumes_exactly_from_the_checkpoint_not_from_its_files(digits6, device_run, tmp_path):
    out = tmp_path / "resumed"
    args = _ditto(digits6, out, "client_state=disk", "checkpoint_every=0")
    with pytest.raises(Preempted):
        run("configs/digits_ditto.yaml", args, wrap=lambda a: PreemptAt(a, 2))
    # a state file newer than (or unlike) the checkpoint must not be used: the checkpoint rules
    files = sorted((out / "client_state" / "rank_0").glob("client_*.pt"))
    assert files
    for f in files:
        torch.save({k: v + 1 for k, v in torch.load(f, weights_only=True).items()}, f)
    lines = []
    run("configs/digits_ditto.yaml", args[:-1] + ["checkpoint_every=1"], echo=lines.append)
    assert any("resuming from" in l and "(2 rounds done)" in l for l in lines)
    _same(device_run, out)


def test_bad_client_state_keys_are_one_line_errors(digits6, tmp_path):
    for kv, key in (("client_state=ram", "client_state"), ("client_state_budget_mb=-1", "client_state_budget_mb")):
        r = run_cmd(["fedcp-run", "--config", "configs/digits_ditto.yaml", f"data.path={digits6}",
                     f"out_dir={tmp_path}", kv], timeout=60)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and f"'{key}'" in err[0], r.stderr


def test_auto_picks_memory_within_the_budget_and_disk_beyond_it():
    # 1,000 clients of 2 MiB: 2,000 MiB
    assert resolve_mode("auto", 2 * MiB, 1000, 2000, "cpu")[0] == "device"
    mode, why = resolve_mode("auto", 2 * MiB, 1000, 1999, "cpu")
    assert mode == "disk" and "1000 x 2.00 MiB vs a budget of 1999 MiB" in why
    assert resolve_mode("host", 2 * MiB, 1000, 1, "cpu") == ("host", "client_state")
    # a state of a few KiB (FedCP's on the synthetic MLP: 2.8 KiB) said "100000 x 0.00 MiB"
    assert resolve_mode("auto", 2867, 100000, 100, "cpu") == (
        "disk", "auto: 100000 x 2.8 KiB = 273.4 MiB vs a budget of 100 MiB")


class _Algo:
    def __init__(self):
        self.made = 0

    def set_global(self, gs):
        pass

    def upload_keys(self, gs):
        return list(gs)

    def init_client_state(self, cid):
        self.made += 1
        return {"w": torch.full((3,), -1.0)}


def test_disk_store_reads_ahead_and_writes_back(tmp_path):
    algo = _Algo()
    store = DiskClientStore(algo, {}, directory=str(tmp_path / "s"))
    assert store.get(7)["w"].tolist() == [-1.0] * 3 and store.peek(7) is None  # never trained: no file
    for c in (1, 2, 3):
        store.put(c, {"w": torch.full((3,), float(c))}, {})
    store.flush()
    assert sorted(p.name for p in (tmp_path / "s").glob("client_*")) == [f"client_{c:07d}.pt" for c in (1, 2, 3)]
    store.prefetch([3, 1, 2])
    assert set(store._ahead) == {3, 1}  # the first two are read ahead at once
    assert store.get(3)["w"].tolist() == [3.0] * 3
    assert set(store._ahead) == {1, 2}  # using 3 read 2 ahead
    assert [store.get(c)["w"].tolist()[0] for c in (1, 2)] == [1.0, 2.0]
    store.put(2, {"w": torch.full((3,), 20.0)}, {})
    assert store.get(2)["w"].tolist() == [20.0] * 3  # the state being written back is the one handed out
    sd = store.state_dict()
    assert {c: s["w"].tolist()[0] for c, s in sd.items()} == {1: 1.0, 2: 20.0, 3: 3.0}
    store.close()
    again = DiskClientStore(_Algo(), {}, directory=str(tmp_path / "s"))  # a new run: old files go
    assert [p.name for p in (tmp_path / "s").iterdir()] == [".lock"]
    again.load_state_dict(sd)
    assert again.get(2)["w"].tolist() == [20.0] * 3 and again.peek(5) is None
    again.close()



@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_disk_store_names_a_damaged_client_file_in_one_line(tmp_path, damage):
    """A client's file cut short or overwritten (another process, a failing disk): reading it is a
    RunFailure naming the file and the way back (the newest checkpoint), not torch's zip reader's
    traceback."""
    store = DiskClientStore(_Algo(), {}, directory=str(tmp_path / "s"))
    store.put(3, {"w": torch.full((3,), 3.0)}, {})
    store.flush()
    path = tmp_path / "s" / "client_0000003.pt"
    data = path.read_bytes()
    path.write_bytes(data[:100] if damage == "cut" else b"\x00garbage" * 50)
    store._recent.clear()
    with pytest.raises(RunFailure) as exc:
        store.get(3)
    msg = str(exc.value)
    assert msg.startswith(f"cannot read the client state file {path}: it is damaged (") and "\n" not in msg
    assert msg.endswith("the run's newest checkpoint holds every client's state: run the same command again to "
                        "resume from it")
    store.close()


def _flip_a_tensor_byte(path: Path) -> None:
    """Flip one byte inside the first tensor's data record of the .pt file ``path`` (same size, the
    zip structure intact, so torch's reader takes the file and reads another value)."""
    import struct
    import zipfile

    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("/data/0"))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_client_file_changed_on_disk_between_rounds_is_refused_not_trained_on(tmp_path):
    """A flipped bit in a client's file (a failing disk, another process) leaves a file that torch
    reads without a word, with another value in it: the store checks each file against what it
    wrote there, so the run stops in one line instead of training on, and checkpointing, the wrong
    state."""
    store = DiskClientStore(_Algo(), {}, directory=str(tmp_path / "s"))
    store.put(3, {"w": torch.full((3,), 3.0)}, {})
    store.put(4, {"w": torch.full((3,), 4.0)}, {})
    store.flush()
    store._recent.clear()
    assert store.get(4)["w"].tolist() == [4.0] * 3  # an intact file reads as written
    path = tmp_path / "s" / "client_0000003.pt"
    size = path.stat().st_size
    _flip_a_tensor_byte(path)
    assert path.stat().st_size == size
    assert torch.load(path, weights_only=True)["w"].tolist() != [3.0] * 3  # torch takes it
    store._recent.clear()
    with pytest.raises(RunFailure) as exc:
        store.get(3)
    msg = str(exc.value)
    assert msg == (f"cannot read the client state file {path}: it is damaged (its bytes are not what the run wrote "
                   f"there: changed on disk since); the run's newest checkpoint holds every client's state: run the "
                   f"same command again to resume from it")
    store.close()


def test_disk_store_writes_a_clients_state_and_residual_in_one_file_write(tmp_path):
    store = DiskClientStore(_Algo(), {}, directory=str(tmp_path / "s"))
    writes = []
    real = store._write
    store._write = lambda cid, entry: writes.append((cid, sorted(entry))) or real(cid, entry)
    store.put(4, {"w": torch.full((3,), 4.0)}, {}, {"w": torch.full((3,), 0.5)})
    store.flush()
    assert writes == [(4, ["__ef__/w", "w"])]  # one write a client a round, both parts in it
    store.put(4, None, {}, {"w": torch.full((3,), 0.25)})  # a residual alone keeps the state
    store.flush()
    assert len(writes) == 2 and store.get(4)["w"].tolist() == [4.0] * 3
    assert store.residual(4)["w"].tolist() == [0.25] * 3
    store.put(5, None, {}, None)  # nothing to keep: no file
    store.flush()
    assert len(writes) == 2 and store.peek(5) is None
    store.close()


def test_cohort_bench_times_training_rounds_and_names_the_store(digits6, capsys, tmp_path):
    """... and leaves no disk store's files in the out_dir it was given (they are the benchmark's)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("cohort", Path(__file__).resolve().parents[1] / "bench" / "cohort.py")
    cohort = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cohort)
    cohort.main(["--config", "configs/digits_ditto.yaml", "--rounds", "1", "--eval", f"data.path={digits6}",
                 "participation=0.5", "threads=1", "client_state=disk", f"out_dir={tmp_path / 'b'}"])
    assert not (tmp_path / "b" / "client_state").exists()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ditto on 6 clients, 1 rank(s), rho=0.5; client states: disk (")
    assert out[1].startswith("round 1: 3 participants") and out[2].startswith("round 2: 3 participants")
    assert "evaluation 0.00 s" in out[2] and "evaluation 0.00 s" not in out[1]
    assert out[3].startswith("rank 0: 6 clients, start-up ")


def test_micro_auc_is_scikit_learns_value_to_the_last_bit():
    import numpy as np
    from sklearn.metrics import roc_auc_score
    from fedcp_dist.engine.evaluation import micro_auc

    # by hand: positives score 0.8 and 0.6, negatives 0.2 and 0.4 -> every pair ordered: 1.0
    assert micro_auc(np.array([0, 1]), np.array([[0.8, 0.2], [0.4, 0.6]], dtype=np.float32)) == 1.0
    assert micro_auc(np.array([0]), np.array([[0.3, 0.7]], dtype=np.float32)) == 0.0  # the one pair reversed
    assert micro_auc(np.array([0, 1]), np.full((2, 2), 0.5, dtype=np.float32)) == 0.5  # all tied
    assert np.isnan(micro_auc(np.array([], dtype=np.int64), np.zeros((0, 3), dtype=np.float32)))
    rng = np.random.default_rng(3)
    for trial in range(300):
        n, k = int(rng.integers(1, 120)), int(rng.integers(2, 11))
        if trial % 2:  # few distinct scores: many ties, and collinear ROC points that are dropped
            p = (rng.integers(0, 4, size=(n, k)) / 4).astype(np.float32)
        else:
            p = rng.random((n, k)).astype(np.float32)
            p /= p.sum(1, keepdims=True)
        y = rng.integers(0, k, size=n)
        onehot = np.zeros(p.shape, dtype=np.int8)
        onehot[np.arange(n), y] = 1
        assert micro_auc(y, p) == float(roc_auc_score(onehot.ravel(), p.ravel())), (n, k, trial)


def test_record_memory_adds_rank_0s_memory_to_every_round(digits6, tmp_path):
    from fedcp_dist.state.client_store import ClientStore
    from fedcp_dist.state.process_memory import memory_record, rss_bytes

    out = tmp_path / "mem"
    run("configs/digits_ditto.yaml", _ditto(digits6, out, "record_memory=true", "rounds=1"))
    rounds = [r for r in _records(out) if r["kind"] == "round"]
    assert len(rounds) == 1
    for r in rounds:
        assert 10 < r["rss_mb"] <= r["peak_rss_mb"] < 64 * 1024
        assert r["client_state_held_mb"] > 0  # Ditto keeps a whole model per client
    # off by default (the golden digests cover the records of runs without it)

    class _A:
        def init_client_state(self, c):
            return None

        def set_global(self, g):
            pass

    store = ClientStore(_A(), {})
    store.put(0, {"w": torch.zeros(2**18)}, {})  # 1 MiB of float32
    store.put(1, None, {}, {"e": torch.zeros(2**17, dtype=torch.float64)})  # a residual alone: 1 MiB
    assert memory_record(store)["client_state_held_mb"] == 2.0
    assert rss_bytes() > 0


def test_soak_summary_compares_the_first_and_last_rounds(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[1] / "bench" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    rows = []
    for r in range(1, 7):  # rounds 1-6; round 4 recorded twice (a resumed run): the later one counts
        rec = {"kind": "round", "round": r, "seconds": float(r), "train_seconds": r / 2, "train_cpu_seconds": r / 4,
               "rss_mb": 100.0 + r,
               "peak_rss_mb": 110.0 + r, "client_state_held_mb": 0.5}
        if r % 3 == 1:
            rec["evaluated_after"] = r - 1
        rows.append(rec)
        if r == 4:
            rows.append({**rec, "seconds": 40.0})
    rows.append({"kind": "final_eval", "round": 6})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ck = tmp_path / "checkpoints" / "round_0000006"
    ck.mkdir(parents=True)
    (ck / "global.pt").write_bytes(b"x" * 10)
    (ck / "clients_0.pt").write_bytes(b"x" * 5)
    s = soak.summarise(tmp_path, window=3)
    assert s["rounds_done"] == 6 and s["checkpoints"] == [(6, 15, 10)]
    f, l = s["first"], s["last"]
    assert (f["rounds"], f["median_s"], f["median_s_no_eval"], f["median_train_s"]) == ("1-3", 2.0, 2.5, 1.0)
    assert (l["rounds"], l["median_s"], l["mean_s"], l["median_s_no_eval"]) == ("4-6", 6.0, 17.0, 5.5)
    assert (f["median_train_cpu_s"], l["median_train_cpu_s"]) == (0.5, 1.25)
    assert (l["median_rss_mb"], l["max_rss_mb"], l["peak_rss_mb"], l["held_mb"]) == (105.0, 106.0, 116.0, 0.5)
    text = soak.format_summary(s)
    assert [l.split()[-2:] for l in text.splitlines() if l.startswith("median s/round ")] == [["2.000", "6.000"]]


# FedCP with a BatchNorm in its CPN (each client keeps its own running statistics) and top-k uploads
# with error feedback (each client keeps its residual): with client_state=disk both live in the
# clients' files, not in memory, and the run is the device store's, bit for bit, resumed or not
def _fedcp_bn_ef(shard, out, *extra):
    return [f"data.path={shard}", f"out_dir={out}", "rounds=3", "eval_every=2", "participation=0.5",
            "checkpoint_every=1", "threads=1", "fused=false", "cpn_layers=2", "cpn_norm=batchnorm",
            "compress=topk", "compress_ratio=0.5", "compress_error_feedback=true", *extra]


def test_bn_statistics_and_residuals_live_in_the_disk_stores_files_and_resume_exactly(digits6, tmp_path):
    from fedcp_dist.state.client_store import BN_PREFIX, EF_PREFIX

    dev = tmp_path / "device"
    run("configs/digits_fedcp.yaml", _fedcp_bn_ef(digits6, dev))
    disk = tmp_path / "disk"
    run("configs/digits_fedcp.yaml", _fedcp_bn_ef(digits6, disk, "client_state=disk"))
    trained = _same(dev, disk)
    _, clients = _final(disk)
    for c in trained:  # each trained client's entry holds its statistics and its residual
        assert any(k.startswith(BN_PREFIX) for k in clients[c]) and any(k.startswith(EF_PREFIX) for k in clients[c])
    on_disk = torch.load(disk / "client_state" / "rank_0" / f"client_{min(trained):07d}.pt", weights_only=True)
    assert on_disk.keys() == clients[min(trained)].keys()
    # stopped in round 2 (its checkpoint after round 1 kept), files spoiled, resumed: the same run
    out = tmp_path / "resumed"
    args = _fedcp_bn_ef(digits6, out, "client_state=disk", "checkpoint_every=0")
    with pytest.raises(Preempted):
        run("configs/digits_fedcp.yaml", args, wrap=lambda a: PreemptAt(a, 2))
    for f in (out / "client_state" / "rank_0").glob("client_*.pt"):
        torch.save({k: v + 1 for k, v in torch.load(f, weights_only=True).items()}, f)
    run("configs/digits_fedcp.yaml", args[:-1] + ["checkpoint_every=1"])
    _same(dev, out)


def test_disk_store_holds_no_per_client_state_in_memory():
    """Memory held by a disk store does not grow with its clients: N=50 vs N=200 clients, each with
    a state, BatchNorm statistics and a residual."""
    import tempfile

    def held(n):
        with tempfile.TemporaryDirectory() as d:
            algo = _Algo()
            mem, disk = ClientStore(algo, {}, ["bn.running_mean"]), DiskClientStore(algo, {}, ["bn.running_mean"], d)
            for store in (mem, disk):
                store.prefetch(range(n))
                for c in range(n):
                    store.activate(c)
                    store.put(c, {"w": torch.full((256,), float(c))}, {"bn.running_mean": torch.zeros(64)},
                              {"e": torch.ones(128)})
                store.flush()
            got = mem.held_bytes(), disk.held_bytes()
            back = disk.state_dict()
            assert back[n - 1]["w"][0] == n - 1 and back[3]["__ef__/e"].sum() == 128 and len(back) == n
            assert disk.residual(7)["e"].tolist() == [1.0] * 128 and disk.peek(7)["w"][0] == 7.0
            disk.close()
            return got

    (m50, d50), (m200, d200) = held(50), held(200)
    assert m50 == 50 * (256 + 64 + 128) * 4 and m200 == 4 * m50  # in memory: N entries
    assert d50 == d200 <= DiskClientStore.RECENT * (256 + 64 + 128) * 4  # on disk: a few entries in flight


@pytest.mark.parametrize("method", ["fedamp", "fedfomo"])
def test_peer_banks_live_in_mapped_files_and_resume_exactly(method, digits6, tmp_path):
    """FedAMP's bank and FedFomo's bank and affinity matrix (a row per client) are files of the disk
    store mapped into memory: the same run as the device store's, bit for bit, resumed or not."""
    cfg = f"configs/digits_{method}.yaml"
    dev, disk = tmp_path / "device", tmp_path / "disk"
    run(cfg, _ditto(digits6, dev))
    run(cfg, _ditto(digits6, disk, "client_state=disk"))
    _same(dev, disk)
    g, _ = _final(disk)
    keys = ("bank", "affinity") if method == "fedfomo" else ("bank",)
    for key in keys:
        mapped = torch.from_file(str(disk / "client_state" / "rank_0" / f"global_{key}.f32"), shared=False,
                                 size=g[key].numel(), dtype=torch.float32).view(g[key].shape)
        assert torch.equal(mapped, g[key]) and bool(g[key].any())
    out = tmp_path / "resumed"
    args = _ditto(digits6, out, "client_state=disk", "checkpoint_every=0")
    with pytest.raises(Preempted):
        run(cfg, args, wrap=lambda a: PreemptAt(a, 2))
    run(cfg, args[:-1] + ["checkpoint_every=1"])
    _same(dev, out)


def test_peer_memory_budget_leaves_out_banks_kept_on_disk():
    from types import SimpleNamespace
    from fedcp_dist.errors import UserError
    from fedcp_dist.engine.startup import check_peer_memory

    algo = SimpleNamespace(peer_dim=2**18 - 1, peer_memory_bytes=lambda n: n * 2**20, device=torch.device("cpu"),  # 1 MiB a client
                           peer_payload=None, receive_peers=None)  # a PeerExchange
    cfg = SimpleNamespace(client_state="device", device="cpu", peer_memory_mb=100.0, method="fedamp")
    # 2 ranks x 10 owned x 1 MiB exchange rows + 50 MiB bank = 70 MiB: fits; 1000 clients' bank does not
    assert check_peer_memory(cfg, algo, 50, 10, 2) == 70 * 2**20
    with pytest.raises(UserError, match="peer_memory_mb=100"):
        check_peer_memory(cfg, algo, 1000, 10, 2)
    cfg.client_state = "disk"  # the bank is a file mapped into memory: only the exchange rows count
    assert check_peer_memory(cfg, algo, 1000, 10, 2) == 20 * 2**20
    algo.device = torch.device("cuda")  # a GPU run keeps its bank in device memory, disk store or not
    with pytest.raises(UserError, match="peer_memory_mb=100"):
        check_peer_memory(cfg, algo, 1000, 10, 2)


def test_fedfomo_on_disk_keeps_8_bytes_per_client_outside_the_store(digits6, tmp_path):
    """Host memory the method holds outside the store, N = 50 vs N = 200: the bank (N x P) and the
    affinity matrix (N x N) are files mapped into memory; only fresh and seen (4 bytes each) remain."""
    from fedcp_dist.algorithms import make_algorithm
    from fedcp_dist.config import load_config
    from fedcp_dist.models import build_model

    own = {}
    for n in (50, 200):
        cfg = load_config("configs/digits_fedfomo.yaml", [f"data.path={digits6}", "client_state=disk", f"out_dir={tmp_path}",
                                                          "device=cpu"])
        algo = make_algorithm("fedfomo", cfg, build_model("cnn", (1, 28, 28), 10), "cpu")
        algo.num_clients = n
        g = algo.init_global_state()
        assert g["bank"].stride()[0] == 0 and g["affinity"].stride()[0] == 0  # one zero row, expanded
        store = DiskClientStore(algo, g, (), str(tmp_path / f"s{n}"), "cpu")
        gs = store.global_state
        assert {k: tuple(gs[k].shape) for k in store.mapped_keys} == {"bank": (n, algo.model_dim), "affinity": (n, n)}
        own[n] = sum(t.numel() * t.element_size() for k, t in gs.items() if t is not store._mapped.get(k))
        vec = torch.arange(algo.peer_dim, dtype=torch.float32)
        out = algo.receive_peers(0, gs, {3: vec, 7: 2 * vec})
        store.set_global(out)
        assert out["bank"] is store._mapped["bank"] and out["affinity"] is store._mapped["affinity"]  # in place
        assert torch.equal(gs["bank"][7], 2 * vec[:algo.model_dim]) and float(gs["affinity"][3, 1]) == algo.model_dim + 1
        assert float(gs["bank"][5].abs().sum()) == 0 and out["fresh"].tolist().count(1.0) == 2
        store.close()
    assert own == {50: 50 * 8, 200: 200 * 8}


# -- a shared client_state_dir -------------------------------------------------------------------------

def test_runs_sharing_a_client_state_dir_keep_apart_and_a_requeue_finds_its_own(digits6, device_run, tmp_path):
    """Two runs given one client_state_dir (array tasks on one node's scratch disk) each get a folder
    of their own, named after their out_dir; the other run's states are neither removed nor read, and
    a requeue (the same out_dir, however spelt) resumes from its own folder exactly."""
    from fedcp_dist.state.disk_store import run_state_dir

    scratch, a, b = tmp_path / "scratch", tmp_path / "a", tmp_path / "b"
    args_a = _ditto(digits6, a, "client_state=disk", f"client_state_dir={scratch}", "checkpoint_every=0")
    said = []
    with pytest.raises(Preempted):
        run("configs/digits_ditto.yaml", args_a, wrap=lambda x: PreemptAt(x, 2), echo=said.append)
    dir_a = run_state_dir(str(a), str(scratch), 0)
    assert dir_a.parent.parent == scratch and dir_a.parent.name.startswith("a-") and dir_a.name == "rank_0"
    assert f"client states: disk ({dir_a})" in said[0]
    kept = {p.name: p.read_bytes() for p in dir_a.glob("client_*.pt")}
    assert kept
    said = []
    run("configs/digits_ditto.yaml", _ditto(digits6, b, "client_state=disk", f"client_state_dir={scratch}"),
        echo=said.append)
    dir_b = run_state_dir(str(b), str(scratch), 0)
    assert dir_b.parent != dir_a.parent and f"client states: disk ({dir_b})" in said[0]
    _same(device_run, b)
    assert {p.name: p.read_bytes() for p in dir_a.glob("client_*.pt")} == kept  # run b left a's states alone
    said = []
    again = [f"out_dir={tmp_path / 'b' / '..' / 'a'}" if x.startswith("out_dir=") else x for x in args_a[:-1]]
    run("configs/digits_ditto.yaml", again + ["checkpoint_every=1"], echo=said.append)
    assert any(f"client states: disk ({dir_a})" in l for l in said) and any("(2 rounds done)" in l for l in said)
    _same(device_run, a)


def test_a_second_store_on_a_held_folder_is_refused_naming_the_holder(tmp_path):
    import socket
    from fedcp_dist.errors import UserError

    folder = tmp_path / "s"
    first = DiskClientStore(_Algo(), {}, directory=str(folder), run="out_dir /runs/x rank 0")
    first.put(1, {"w": torch.ones(3)}, {})
    first.flush()
    with pytest.raises(UserError) as exc:
        DiskClientStore(_Algo(), {}, directory=str(folder))
    assert str(exc.value).startswith(f"client_state_dir {folder} is in use by another run "
                                     f"(host {socket.gethostname()} pid {os.getpid()} out_dir /runs/x rank 0)")
    assert first.get(1)["w"].tolist() == [1.0] * 3  # the refused store removed nothing
    first.close()
    second = DiskClientStore(_Algo(), {}, directory=str(folder))  # released: the folder may be used again
    assert second.peek(1) is None and not list(folder.glob("client_*"))
    second.close()


def test_a_run_on_a_held_client_state_folder_is_one_line_exit_2(digits6, tmp_path, capsys):
    from fedcp_dist.state.disk_store import run_state_dir
    from fedcp_dist.run import main

    scratch, out = tmp_path / "scratch", tmp_path / "run"
    holder = DiskClientStore(_Algo(), {}, directory=str(run_state_dir(str(out), str(scratch), 0)), run="the holder")
    holder.put(3, {"w": torch.ones(3)}, {})
    holder.flush()
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/digits_ditto.yaml",
              *_ditto(digits6, out, "client_state=disk", f"client_state_dir={scratch}", "rounds=1")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: client_state_dir ") and f"pid {os.getpid()} the holder" in err, err
    assert holder.get(3)["w"].tolist() == [1.0] * 3 and not (out / "metrics.jsonl").exists()
    holder.close()


# -- a full disk under the store -------------------------------------------------------------------

def test_full_disk_under_the_store_is_one_line_and_leaves_no_temporary_file(digits6, device_run, tmp_path, capsys,
                                                                            monkeypatch):
    """The store's 4th file (round 2) meets a full disk in its background write: one line naming the
    file, exit 1, no .tmp file left, the checkpoint after round 1 intact, and the run, restarted once
    there is room, is the device store's bit for bit."""
    import re
    from helpers import client_state_saves_fail
    from fedcp_dist.run import main

    out = tmp_path / "full"
    args = ["--config", "configs/digits_ditto.yaml", *_ditto(digits6, out, "client_state=disk")]
    monkeypatch.setattr(torch, "save", client_state_saves_fail(torch.save, 4))
    with pytest.raises(SystemExit) as exc:
        main(args)
    monkeypatch.undo()
    err = capsys.readouterr().err
    folder = out / "client_state" / "rank_0"
    assert exc.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.fullmatch(rf"error: cannot write the client state file {re.escape(str(folder))}/client_\d{{7}}\.pt: "
                        r"No space left on device\n", err), err
    assert not [p for p in folder.iterdir() if "tmp" in p.name]
    ck = Checkpointer(str(out), 0, 1, 1)
    assert ck.latest().name == "round_0000001" and ck.verify(ck.latest()) is None
    said = []
    run("configs/digits_ditto.yaml", args[2:], echo=said.append)
    assert any("(1 round done)" in l for l in said)
    _same(device_run, out)


def test_a_run_refused_after_start_up_releases_its_folders(digits6, tmp_path):
    """A resume refused after the store was made (a changed lr) leaves neither out_dir nor the
    store's folder locked: the same process then resumes the run with its own config."""
    from fedcp_dist.errors import UserError

    out = tmp_path / "r"
    args = _ditto(digits6, out, "client_state=disk", f"client_state_dir={tmp_path / 'scratch'}", "rounds=2",
                  "checkpoint_every=0")
    with pytest.raises(Preempted):
        run("configs/digits_ditto.yaml", args, wrap=lambda x: PreemptAt(x, 1))
    with pytest.raises(UserError, match="config key 'lr'"):
        run("configs/digits_ditto.yaml", args + ["lr=0.5"])
    said = []
    run("configs/digits_ditto.yaml", args, echo=said.append)
    assert any("(1 round done)" in l for l in said) and (out / "summary.json").exists()


def test_an_io_error_nothing_else_names_is_one_line_naming_rank_phase_and_file(digits6, tmp_path, capsys,
                                                                              monkeypatch):
    """An older checkpoint's part that cannot be read while the checkpoint after round 2 chooses
    which to keep (an I/O error of the disk): one line naming the rank, what it was doing and the
    file, exit 1."""
    import errno
    from fedcp_dist.rundir import checkpoint
    from fedcp_dist.run import main

    real_sha, bad = checkpoint._sha256, []

    def eio(path):
        if path.parent.name == "round_0000001" and path.name == "global.pt" and (path.parent.parent /
                                                                                "round_0000002").exists():
            bad.append(str(path))
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_sha(path)

    monkeypatch.setattr(checkpoint, "_sha256", eio)
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/digits_ditto.yaml", *_ditto(digits6, tmp_path / "run", "client_state=disk", "rounds=2")])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err, err
    assert err == f"error: rank 0, checkpoint after round 2: {bad[0]}: Input/output error\n"


class _DamageBankAt(PreemptAt):
    """As round ``r`` begins, ``damage(path)`` the rank's bank file (``global_bank.f32`` of the
    disk store) as another process would."""

    def __init__(self, algo, r, path, damage):
        super().__init__(algo, r)
        self.__dict__.update(path=path, damage=damage)

    def begin_round(self, t):
        if t + 1 == self.r:
            self.damage(self.path)
        return self.algo.begin_round(t)

    def local_train(self, state, data, ctx):
        return self.algo.local_train(state, data, ctx)


def _flip_bank_byte(path):
    with open(path, "r+b") as f:
        f.seek(4 * 7)  # row 0, a value every round's mixing reads
        b = f.read(1)
        f.seek(4 * 7)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("method, damage, says", [
    ("fedamp", _flip_bank_byte, "(row 0 is not what the run wrote there)"),
    ("fedfomo", _flip_bank_byte, "(row 0 is not what the run wrote there)"),
    ("fedamp", lambda p: os.truncate(p, 100), "was cut to 100 of its"),
])
def test_a_peer_bank_file_changed_on_disk_stops_the_run_and_the_resume_is_exact(method, damage, says, digits6,
                                                                                 tmp_path):
    """FedAMP's and FedFomo's banks are files mapped into memory: a byte changed there (another
    process, a failing disk) was read by the next rounds, checkpointed with a fresh checksum and
    reported, exit 0 with other results; a truncated file ended the process with SIGBUS. The run
    now stops in one line naming the file, its previous checkpoint intact, and the resume ends
    where an uninterrupted run does."""
    cfg = f"configs/digits_{method}.yaml"
    ref, out = tmp_path / "ref", tmp_path / "damaged"
    run(cfg, _ditto(digits6, ref, "client_state=disk", "rounds=4", "checkpoint_every=2"))
    args = _ditto(digits6, out, "client_state=disk", "rounds=4", "checkpoint_every=2")
    bank = out / "client_state" / "rank_0" / "global_bank.f32"
    with pytest.raises(RunFailure) as exc:
        run(cfg, args, wrap=lambda a: _DamageBankAt(a, 3, bank, damage))
    assert str(bank) in str(exc.value) and says in str(exc.value) and "\n" not in str(exc.value)
    assert not (out / "summary.json").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["round_0000002"]
    run(cfg, args)
    assert _records(ref) == _records(out)
    (ga, _), (gb, _) = _final(ref), _final(out)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_resume_refused_after_the_disk_store_opened_leaves_no_store_folder(digits6_16px, tmp_path, elsewhere):
    """A resume that the checkpoint's config refuses (another seed) with ``client_state: disk``: the
    store had made its folder and lock file by then (``out_dir/client_state/rank_0/.lock``, or one
    under client_state_dir), left behind by a start that changed nothing else. Now they go again."""
    from fedcp_dist.errors import UserError
    from helpers import run

    out = tmp_path / "run"
    base = [f"data.path={digits6_16px}", f"out_dir={out}", "rounds=2", "checkpoint_every=1", "threads=1"]
    run("configs/digits_fedcp.yaml", base)
    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    store = [f"client_state_dir={tmp_path / 'scratch' / 'states'}"] if elsewhere else []
    with pytest.raises(UserError, match="config key 'seed' is 2"):
        run("configs/digits_fedcp.yaml", [*base, "seed=2", "client_state=disk", *store])
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_run_on_fewer_ranks_removes_the_store_folders_of_the_ranks_it_has_not(digits6_16px, tmp_path):
    """A run stopped on 2 ranks and resumed on 1 left ``client_state/rank_1`` with its files (14 MB
    in a 100k-client probe) that no rank owned or cleaned. Rank 0 removes the folders of ranks the
    run no longer has, except one a live process holds (its lock)."""
    import fcntl

    from helpers import run

    out = tmp_path / "run"
    stale, held = out / "client_state" / "rank_1", out / "client_state" / "rank_2"
    for d in (stale, held):
        d.mkdir(parents=True)
        (d / "client_0000003.pt").write_bytes(b"an earlier attempt's state")
    said = []
    with open(held / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's, as far as the run can tell
        run("configs/digits_fedcp.yaml", [f"data.path={digits6_16px}", f"out_dir={out}", "rounds=1", "threads=1",
                                          "client_state=disk"], echo=said.append)
    assert not stale.exists() and (held / "client_0000003.pt").is_file() and (out / "client_state" / "rank_0").is_dir()
    assert any("removed the folder of rank 1 left by an attempt on more ranks" in line for line in said), said


def test_a_long_evaluation_says_how_far_it_is(digits6_16px, tmp_path, monkeypatch):
    """An evaluation of 10⁵ clients ran 45 s without a line. Every PROGRESS_S seconds (here: at every
    client) rank 0 says how many of its clients it has evaluated."""
    from fedcp_dist.engine import evaluation
    from helpers import run

    monkeypatch.setattr(evaluation, "PROGRESS_S", 0.0)
    said = []
    run("configs/digits_fedcp.yaml", [f"data.path={digits6_16px}", f"out_dir={tmp_path / 'run'}", "rounds=1",
                                      "threads=1", "eval_every=1"], echo=said.append)
    lines = [line for line in said if line.startswith("  evaluating: ")]
    # two evaluations (before round 1, after it), each of the 6 clients
    assert [line.split(" after ")[0] for line in lines] == [f"  evaluating: {i:,} of this rank's 6 clients"
                                                            for _ in range(2) for i in range(6)], lines
