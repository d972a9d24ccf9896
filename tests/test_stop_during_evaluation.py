"""A preemption signal during a round's evaluation (10^5 clients take minutes, more than a
scheduler's warning may leave) stops every rank before that round trains: the rounds done are
checkpointed (unless the newest checkpoint holds them), exit 75, and the restart ends as an
uninterrupted run, bit for bit, on one rank or two, whichever rank got the signal."""
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_cmd
from helpers import rank_envs, run, run_hand_ranks

from fedcp_dist.engine.evaluation import EvalSums, evaluate_clients
from fedcp_dist.rundir.checkpoint import Checkpointer

ROUNDS = 4


def _settings(shard, out, method, *extra):
    return [f"data.path={shard}", f"out_dir={out}", f"method={method}", f"rounds={ROUNDS}", "eval_every=1",
            "threads=1", *extra]


def _outcome(out: Path) -> tuple:
    state = torch.load(out / "final_global.pt", weights_only=True)
    rows = [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    return state, rows


def _same(out: Path, ref: Path) -> None:
    (sa, ra), (sb, rb) = _outcome(out), _outcome(ref)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), "another final state"
    assert ra == rb, "other metric records"


def test_the_evaluation_ends_before_its_next_client_once_asked():
    class Data:
        n_test, test_y = 2, torch.tensor([0, 1])

        def test_batch(self, i, j):
            return torch.zeros(j - i, 1), None

    class Method:
        def prepare_eval(self, state, d, ctx):
            return state

        def predict(self, state, x, ctx):
            return torch.tensor([[2.0, 0.0], [0.0, 2.0]])[: len(x)]

    class Store:
        def activate(self, cid):
            return {}

    asked = iter([False, False, True, True])
    sums = evaluate_clients(Method(), Store(), {c: Data() for c in range(4)}, range(4), 0, lambda t, c: None, 8,
                            stop=lambda: next(asked))
    assert isinstance(sums, EvalSums) and sums.clients == 2.0 and sums.test_samples == 4.0 and sums.correct == 4.0


@pytest.mark.slow
@pytest.mark.parametrize("method,every,extra", [("perfedavg", 5, ["client_state=disk"]), ("fedcp", 2, [])])
def test_a_signal_during_an_evaluation_checkpoints_the_rounds_done_and_the_restart_is_the_same_run(
        digits6_16px, tmp_path, method, every, extra):
    """Per-FedAvg adapts each client before evaluating it (its state must stay as it was); with
    checkpoint_every=5 the rounds done (2) are checkpointed at the signal, with 2 the newest
    checkpoint holds them already."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    run("configs/digits_fedcp.yaml", _settings(digits6_16px, ref, method, f"checkpoint_every={every}", *extra))
    r = run_cmd(["fedcp-run", "--config", "configs/digits_fedcp.yaml",
                 *_settings(digits6_16px, out, method, f"checkpoint_every={every}", *extra)],
                env_extra={"FEDCP_FAULT_AT": "eval@3:SIGUSR2"})
    assert r.returncode == 75, r.stdout + r.stderr
    done = "checkpointed" if every == 5 else "the newest checkpoint is"
    assert f"asked to stop during round 3's evaluation; {done} after 2 rounds; exiting with status 75" in r.stdout, r.stdout
    assert r.stderr.strip().splitlines()[-1] == (f"preempted: checkpointed after 2 rounds in {out} (round 3's "
                                                 f"evaluation stopped)"), r.stderr
    assert "[round 3/" not in r.stdout and len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert Checkpointer(str(out), 0, 1, 2).latest().name == "round_0000002"
    run("configs/digits_fedcp.yaml", _settings(digits6_16px, out, method, f"checkpoint_every={every}", *extra))
    _same(out, ref)


@pytest.mark.slow
def test_the_signal_on_one_rank_of_two_stops_both_before_training(digits6_16px, tmp_path):
    """Rank 1 alone gets SIGTERM during round 2's evaluation: both ranks stop before training it,
    rank 0 says so, both exit 75; the restart, on one rank, ends as the uninterrupted run."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    run("configs/digits_fedcp.yaml", _settings(digits6_16px, ref, "fedcp", "checkpoint_every=3"))
    envs = rank_envs(2)
    envs[1]["FEDCP_FAULT_AT"] = "eval@2:SIGTERM"
    cmd = [sys.executable, "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml",
           *_settings(digits6_16px, out, "fedcp", "checkpoint_every=3")]
    (c0, out0, err0), (c1, out1, err1) = run_hand_ranks([cmd, cmd], envs)
    assert (c0, c1) == (75, 75), (err0[-2000:], err1[-2000:])
    assert "asked to stop during round 2's evaluation; checkpointed after 1 round; exiting with status 75" in out0, out0
    assert "rank 1: got SIGTERM" in out1 and "Traceback" not in err0 + err1
    assert Checkpointer(str(out), 0, 2, 2).latest().name == "round_0000001"
    run("configs/digits_fedcp.yaml", _settings(digits6_16px, out, "fedcp", "checkpoint_every=3"))
    _same(out, ref)


def test_a_signal_during_round_1s_evaluation_leaves_nothing_to_resume(digits6_16px, tmp_path):
    out = tmp_path / "run"
    r = run_cmd(["fedcp-run", "--config", "configs/digits_fedcp.yaml",
                 *_settings(digits6_16px, out, "fedavg", "checkpoint_every=2")],
                env_extra={"FEDCP_FAULT_AT": "eval@1:SIGTERM"})
    assert r.returncode == 75 and "exiting with status 75 (nothing to checkpoint)" in r.stdout, r.stdout + r.stderr
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


@pytest.mark.parametrize("every", [0, 3])
def test_a_signal_during_the_final_evaluation_stops_it_and_the_restart_does_it_again(digits6_16px, tmp_path, every):
    """The final evaluation went on to its end whatever signal came (every client of 10⁵: 150 s more,
    past a scheduler's grace), its rank line promising a round and a checkpoint. It stops as a
    round's evaluation does: the rounds checkpointed (checkpoint_every=0: at the signal; 3: the last
    round's checkpoint holds them), exit 75, and the restart evaluates and ends as an uninterrupted run."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    run("configs/digits_fedcp.yaml", _settings(digits6_16px, ref, "fedper", f"checkpoint_every={every}"))
    r = run_cmd(["fedcp-run", "--config", "configs/digits_fedcp.yaml",
                 *_settings(digits6_16px, out, "fedper", f"checkpoint_every={every}")],
                env_extra={"FEDCP_FAULT_AT": f"eval@{ROUNDS + 1}:SIGUSR2"})
    assert r.returncode == 75, r.stdout + r.stderr
    assert "rank 0: got SIGUSR2; stopping the final evaluation (a restart does it again)" in r.stdout, r.stdout
    done = "checkpointed" if every == 0 else "the newest checkpoint is"
    assert f"asked to stop during the final evaluation; {done} after {ROUNDS} rounds; exiting with status 75" in r.stdout
    assert "[final]" not in r.stdout and not (out / "summary.json").exists()
    assert Checkpointer(str(out), 0, 1, 2).latest().name == f"round_{ROUNDS:07d}"
    run("configs/digits_fedcp.yaml", _settings(digits6_16px, out, "fedper", f"checkpoint_every={every}"))
    _same(out, ref)
