"""Every method's results on the digits shard equal the digests recorded before the engine was
reshaped (tests/golden/digests.json): bit for bit on the machine kind they were recorded on,
within a small accuracy tolerance elsewhere. A change of a default's results shows up here."""
import json
import sys

import pytest
import torch

from conftest import REPO, run_cmd
from golden.record import CASES, METHODS, differences, fingerprint, run_case

RECORDED = json.loads((REPO / "tests" / "golden" / "digests.json").read_text())
EXACT = RECORDED["fingerprint"] == fingerprint()


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("case", [*METHODS, "fedcp-fused", "fedavg-fused", "fedcp-cpn-2bn", "fedcp-no-cpn"])
def test_one_rank_matches_the_recorded_digests(case, digits20, tmp_path, one_thread):
    from fedcp_dist.runtime import init_runtime

    rt = init_runtime("cpu", 1, env={})
    try:
        got = run_case(rt, str(digits20), case, tmp_path)
    finally:
        rt.close()
    assert differences(RECORDED["world_sizes"]["1"][case], got, EXACT) == []


@pytest.mark.slow
def test_two_ranks_match_the_recorded_digests(digits20):
    # the default (fused) FedCP path and a peer-exchange method; every other method's 1-vs-2-rank
    # agreement is checked by tests/test_baselines.py and tests/test_fedcp_switch_runs.py
    cases = ["fedcp-fused", "fedamp"]
    assert set(cases) <= set(CASES)
    r = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(REPO / "tests" / "golden" / "record.py"), "--check", str(REPO / "tests" / "golden" / "digests.json"),
                 "--shard", str(digits20), "--cases", *cases], timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"{len(cases)} of {len(cases)} cases" in r.stdout
