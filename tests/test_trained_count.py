"""How many of the clients an evaluation covers have trained by then (partial participation).

At 10⁵ clients and a cohort of 100, most evaluated clients have never been in a cohort: their
personalized accuracy is that of the state they started with, and nothing said how many there
were. Each evaluation's record says it (``eval_clients_trained``), the summary and the result
table give the final one; counted from the cohorts themselves, drawn again on a resume."""
import json

import numpy as np

from fedcp_dist.state.placement import sample_cohort
from tests.helpers import run


def records(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def overrides(shard, out, *extra):
    return [f"data.path={shard}", f"out_dir={out}", "threads=1", "eval_every=1", "participation=0.34",
            "seed=5", "checkpoint_every=2", *extra]


def test_each_evaluation_counts_the_clients_the_earlier_cohorts_held(digits6_16px, tmp_path):
    summary = run("configs/digits_fedper.yaml", overrides(digits6_16px, tmp_path / "a", "rounds=4"))
    rec = records(tmp_path / "a")
    seen, want = set(), []
    for t in range(5):  # the evaluations before rounds 1 … 4 and the final one: the cohorts of the rounds before
        want.append(len(seen))
        if t < 4:
            cohort = sample_cohort(5, t, 6, 0.34)
            assert len(cohort) == 2
            seen.update(int(c) for c in cohort)
    got = [r["eval_clients_trained"] for r in rec if "eval_clients_trained" in r]
    assert got == want and want[0] == 0 and want[-1] == len(seen), (got, want)
    assert summary["final_eval_clients_trained"] == want[-1]


def test_a_resumed_run_counts_as_an_uninterrupted_one_and_full_participation_says_nothing(digits6_16px, tmp_path):
    whole = run("configs/digits_fedper.yaml", overrides(digits6_16px, tmp_path / "a", "rounds=4"))
    run("configs/digits_fedper.yaml", overrides(digits6_16px, tmp_path / "b", "rounds=2"))
    (tmp_path / "b" / "summary.json").unlink()  # a run stopped after its checkpoint of round 2
    resumed = run("configs/digits_fedper.yaml", overrides(digits6_16px, tmp_path / "b", "rounds=4"))
    count = [[r.get("eval_clients_trained") for r in records(tmp_path / d)] for d in "ab"]
    assert count[0] == count[1] and resumed["final_eval_clients_trained"] == whole["final_eval_clients_trained"]
    full = run("configs/digits_fedper.yaml", overrides(digits6_16px, tmp_path / "c", "rounds=1", "participation=1"))
    assert "final_eval_clients_trained" not in full
    assert not any("eval_clients_trained" in r for r in records(tmp_path / "c"))
    assert np.isfinite(resumed["final_acc"])
