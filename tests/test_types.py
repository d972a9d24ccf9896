"""The fused path's contract, checked by a type checker: mypy (mypy.ini says what it checks) holds
the Step protocol (fedcp_dist.local_train.StepOps) and both of its implementations, the sequential
Step and the fused FusedStep, with the fused package that calls a phase's loss on them, and the test
fails on any error there. A step whose operation drifts from the protocol (a renamed argument, a
missing operation) fails here before it fails at run time on one of the two paths."""
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("mypy")

#: a step that drifts from the protocol: its ``mean`` takes another argument list
DRIFTED = """import torch
from fedcp_dist.fused.step import FusedStep
from fedcp_dist.local_train import Phase


class Drifted(FusedStep):
    def mean(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return values


def train(phase: Phase, step: Drifted) -> torch.Tensor:
    return phase.loss(step)
"""


def test_the_fused_package_and_local_training_type_check(tmp_path):
    """One mypy run over the checked files and a drifted step: no error in the project's files,
    and the drifted step is refused as a StepOps (so the check can fail)."""
    bad = tmp_path / "drifted_step.py"
    bad.write_text(DRIFTED)
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"),
                        "--cache-dir", str(tmp_path / "cache"), "fedcp_dist/local_train.py", "fedcp_dist/fused",
                        str(bad)], cwd=REPO, capture_output=True, text=True, timeout=240)
    errors = [line for line in r.stdout.splitlines() if re.search(r":\d+: error:", line)]
    ours = [line for line in errors if not line.startswith(str(bad))]
    assert ours == [], "\n".join(ours)
    drifted = [line for line in errors if line.startswith(str(bad))]
    assert len(drifted) == 1 and '"Drifted"' in drifted[0] and '"StepOps"' in drifted[0], r.stdout[-3000:]
