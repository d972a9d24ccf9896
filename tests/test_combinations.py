"""Every option of every method in pairwise combinations (tests/combinations.py): the value table
covers every config key, the array covers every pair the config accepts, every pair the config
refuses is refused in one line naming both keys, and a sample of the array's rows runs to finite
accuracies on both training paths. The whole array: ``python bench/combinations.py``."""
import functools
import json
import math
import sys

import pytest

import combinations as C
from conftest import run_cmd
from fedcp_dist.algorithms import ALGORITHMS

METHODS = list(ALGORITHMS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return C.tiny_shard(tmp_path_factory.mktemp("combinations"))


def _varied() -> set:
    return {k for k in C.universe() if C.values(k)}


def test_every_config_key_is_varied_or_held_with_a_reason():
    """A new key fails here until its declaration gives it values (a boolean, one_of, within,
    at_least), or it has values in VALUES, or a reason in FIXED."""
    keys = set(C.universe())
    assert not set(C.VALUES) & set(C.FIXED)
    assert keys - _varied() - set(C.FIXED) == set(), "declare the new keys' values, or add them to VALUES or FIXED"
    assert (set(C.VALUES) | set(C.FIXED)) - keys == set(), "keys that no longer exist"
    assert all(reason for reason in C.FIXED.values())
    assert set(C.START_REFUSED) <= _varied()
    # VALUES lists only what the declarations cannot give: a key whose values they give is not there
    assert [k for k, v in C.VALUES.items() if json.dumps(C.declared_values(k)) == json.dumps(v)] == []
    # every value is one of the key's own: some method accepts it alone, or it is refused alone
    # only for the key it needs (participation_draw=count needs participation_range), or named as
    # having no effect alone for the key it needs (dp_clip needs dp=central)
    for key in sorted(_varied()):
        for v in C.values(key):
            assert v != C.default(key), (key, v)
            methods = [m for m in METHODS if key in C.keys_for(m)]
            assert methods, f"{key} acts on no method"
            assert any(C.accepted(m, {key: v}) or C.single_refusal_ok(m, key, str(C.config_of(m, {key: v})))
                       or C.inert_alone_ok(m, key, v) for m in methods), (key, v)


def test_a_key_missing_from_the_table_is_noticed(monkeypatch):
    """tau (> 0) gives no values of its own: without its row in VALUES it is noticed."""
    monkeypatch.setattr(C, "VALUES", {k: v for k, v in C.VALUES.items() if k != "tau"})
    assert set(C.universe()) - _varied() - set(C.FIXED) == {"tau"}


def test_values_derive_from_the_declarations():
    """The other truth value, the other choices, the accepted ends of a range, the lowest value;
    a float key's bound as a float; none for a held key or an unbounded one."""
    assert C.declared_values("drop_last") == [False] and C.declared_values("analysis") == [True]
    assert C.declared_values("cpn_norm") == ["batchnorm", "groupnorm", "none"]
    assert C.declared_values("compress_bits") == [16, 8]
    assert C.declared_values("selection_min_prob") == [1.0]  # within (0, 1]: its closed end
    assert C.declared_values("lam") == [0.0] and isinstance(C.declared_values("lam")[0], float)
    assert C.declared_values("keep_checkpoints") == [1]  # at_least(1), default 2
    assert C.declared_values("fused_group") == [] and C.values("fused_group") == [1, 2]  # at_least(0) is its default
    assert C.declared_values("model") == [] and C.values("model") == []  # held (FIXED)
    assert C.declared_values("tau") == [] and C.values("tau") == [0.1]  # > 0: VALUES gives it


@pytest.mark.parametrize("method", METHODS)
def test_refused_values_and_pairs_name_both_keys(method):
    """Each value the config refuses alone names its key and what it conflicts with; each pair of
    values accepted alone and refused together is refused in one line whose ``config key 'X'``
    prefix is one of the pair and whose text names the other."""
    for key, value, err in C.refused_singles(method):
        assert C.single_refusal_ok(method, key, str(err)), (key, value, str(err))
    for pair, err in C.refused_pairs(method):
        msg = str(err)
        assert "\n" not in msg and C.refused_key(msg) in pair, (pair, msg)
        assert sorted(C.names_keys(msg, list(pair))) == sorted(pair), (pair, msg)


def test_fedcp_refuses_some_pairs_and_the_array_covers_every_other():
    pairs = C.refused_pairs("fedcp")
    assert len(pairs) >= 20  # the sync switches, the ablations, compression, the CPN's design
    rows = C.array("fedcp")
    assert all(C.accepted("fedcp", r) for r in rows)
    assert C.uncovered_pairs("fedcp", rows) == []
    # both training paths, both rank counts, the probes, every value of every key in some row
    for key, values in C.parameters("fedcp").items():
        for v in values:
            assert any(r[key] == v for r in rows), (key, v)
    # no refused pair in any row
    for pair, _ in pairs:
        assert not any(all(r[k] == v for k, v in pair.items()) for r in rows), pair


SAMPLE_METHODS = ("fedcp", "fedavg", "ditto", "fedrep", "fedcp", "fedprox", "fedphp", "fedrod")


@functools.lru_cache(maxsize=None)
def _sample():
    """A deterministic handful of one-rank rows across methods, fused=false and fused=auto/true
    alternating, from the cheaper rows (no batch_size=1)."""
    out = []
    for i, method in enumerate(SAMPLE_METHODS):
        want_fused = i % 2 == 1
        taken = [(m, k) for m, k, _ in out]
        cheap = [(j, row) for j, row in enumerate(C.array(method))
                 if row[C.RANKS] == 1 and row["batch_size"] != 1 and row.get("fedrep_head_epochs", 1) == 1
                 and (method, j) not in taken]
        j, row = next(((j, row) for j, row in cheap if (row["fused"] is not False) == want_fused), cheap[0])
        out.append((method, j, row))
    return out


@pytest.mark.parametrize("i", range(len(SAMPLE_METHODS)))
def test_a_sample_of_the_array_runs_to_finite_accuracies(tiny, tmp_path, i):
    method, index, row = _sample()[i]
    o = C.run_row(method, row, tiny, tmp_path / "run")
    assert o.kind == "ran", (method, index, o, C.describe(row))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("best_acc", "final_acc", "final_acc_client_mean"):
        assert math.isfinite(summary[key]) and 0 <= summary[key] <= 1
    assert summary["rounds"] == row["rounds"]


def test_the_sample_takes_both_training_paths():
    sample = _sample()
    assert len(sample) == len(SAMPLE_METHODS)
    assert {row["fused"] is False for _, _, row in sample} == {True, False}


@pytest.mark.parametrize("method,key,value", [(m, k, v) for m in ("fedcp", "fedamp") for k, vs in
                                              C.START_REFUSED.items() if k in C.keys_for(m) for v in vs])
def test_values_the_start_up_refuses_name_the_key(tiny, tmp_path, method, key, value):
    o = C.run_row(method, {key: value}, tiny, tmp_path / "run")
    assert o.kind == "refused" and C.refused_key(o.detail) == key, o
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _refused_rows():
    """A refused pair of FedCP's sync switches, one of its ablations, a value refused alone for a
    method, and a start-up refusal."""
    return [
        ("fedcp", {"policy_refresh_every": 2, "cpn_upload_every": 2}, ("cpn_upload_every", "policy_refresh_every")),
        ("fedcp", {"fedcp_cpn": False, "analysis_every": 2}, ("analysis_every", "fedcp_cpn")),
        ("fedfomo", {"compress": "topk"}, ("compress", "fedfomo")),
        ("fedcp", {"cpn_groups": 3}, ("cpn_groups",)),
    ]


@pytest.mark.parametrize("method,row,words", _refused_rows(), ids=lambda v: str(v)[:40])
def test_fedcp_run_refuses_in_one_line_with_exit_2(tiny, tmp_path, method, row, words):
    flat = {**C.BASE, "method": method, "out_dir": str(tmp_path / "run"), "data.path": str(tiny), **row}
    r = run_cmd([sys.executable, "-m", "fedcp_dist.run", *C._overrides(flat)], timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: config key '")
    for w in words:
        assert w in r.stderr, r.stderr


# -- rows the array found failing, each fixed (a refusal or a repair) --------------------------------

@pytest.mark.parametrize("other", [{"batch_size": 1}, {"drop_last": False}])
def test_a_batchnorm_cpn_trains_batches_of_one_sample(other, tiny, tmp_path):
    """Was: ValueError 'Expected more than 1 value per channel when training' in a batch of one; such
    a batch is now normalised by the layer's running statistics (fedcp_dist/models/batchnorm.py)."""
    row = {"cpn_norm": "batchnorm", "fused": False, **other}
    assert C.accepted("fedcp", row)
    o = C.run_row("fedcp", row, tiny, tmp_path / "run")
    assert o.kind == "ran", (o, C.describe(row))


def test_the_probes_refused_without_a_cpn_name_the_key_set():
    """Was: 'config key 'analysis'' for a config that set analysis_every only."""
    err = C.config_of("fedcp", {"fedcp_cpn": False, "analysis_every": 2})
    assert C.refused_key(str(err)) == "analysis_every"


@pytest.mark.slow
def test_a_two_rank_row_under_torchrun(tiny, tmp_path):
    """A FedCP row of the array on two ranks: exit 0 and finite accuracies."""
    row = next(r for r in C.array("fedcp") if r[C.RANKS] == 2 and r["batch_size"] != 1)
    o = C.run_row("fedcp", row, tiny, tmp_path / "run")
    assert o.kind == "ran", (o, C.describe(row))


@pytest.mark.slow
def test_a_start_up_refusal_on_two_ranks_is_each_ranks_one_line(tiny, tmp_path):
    """Every rank prints the same one line and exits 2; torchrun adds its own report of a failed worker."""
    o = C.run_row("fedcp", {C.RANKS: 2, "cpn_groups": 3}, tiny, tmp_path / "run")
    assert o.kind == "refused" and C.refused_key(o.detail) == "cpn_groups", o
