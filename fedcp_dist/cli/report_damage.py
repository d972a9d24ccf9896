"""Why a run folder's files cannot be read as its result, for ``fedcp-report``
(:mod:`fedcp_dist.cli.report_runs`): a config.yaml missing, damaged, cut short or contradicted by
summary.json (its setting unknown: the run is listed apart, not filed under a setting), records that
stop short of the rounds summary.json says the run did (the metrics read from them unknown), and a
summary not there yet (a run going on) or damaged. Each returns "" when nothing is wrong."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from fedcp_dist.config import Config, flatten
from fedcp_dist.rundir.directory import CONFIG, METRICS, SUMMARY, RunDir, contradiction

#: keys every config.yaml a run writes holds (it writes them all)
RUN_KEYS = ("method", "rounds", "seed")


def config_problem(path: Path, config: Optional[dict], summary: Optional[dict]) -> str:
    """Why a run's config (``config``: its config.yaml as read, flat) cannot tell its setting: no
    config.yaml, one that is not a YAML mapping, or, for a finished run (``summary``), one that
    lacks keys every run writes (a file cut at a line end still reads as YAML) or that the summary
    contradicts (an edited method filed a FedCP result under fedavg)."""
    if not (path / CONFIG).exists():
        return f"no {CONFIG}: its setting is unknown"
    if config is None:
        return f"{CONFIG} is damaged (not a YAML mapping): its setting is unknown"
    if not isinstance(summary, dict):
        return ""
    missing = [k for k in RUN_KEYS if k not in config]
    if missing:
        return f"{CONFIG} lacks {', '.join(missing)} (cut short or edited): its setting is unknown"
    written = flatten(Config().to_dict())  # a run writes every key (an older version: most of today's)
    lacking = sum(1 for k in written if k not in config)
    if lacking > len(written) // 2:
        return (f"{CONFIG} lacks {lacking} of the {len(written)} keys a run writes (cut short or edited): its setting "
                f"is unknown")
    contradicted = contradiction(config, summary)
    return f"{contradicted}, so its setting is unknown" if contradicted else ""


def cut_short(records: list, summary: Optional[dict]) -> str:
    """What is wrong with a finished run's records (its metrics.jsonl, read whole) that do not reach
    the end its summary.json says it reached: "" when they do, or when there is no summary."""
    if not isinstance(summary, dict) or not isinstance(summary.get("rounds"), int):
        return ""
    rounds = [int(r["round"]) for r in records if r.get("kind", "round") == "round" and isinstance(r.get("round"), int)]
    last = max(rounds, default=0)
    # the final evaluation's record (kind final_eval) closes every finished run's file since records had a kind
    final = any(r.get("kind") == "final_eval" for r in records) or not any("kind" in r for r in records)
    if last >= summary["rounds"] and final:
        return ""
    return (f"{METRICS} ends after round {last} of the {summary['rounds']} that {SUMMARY} says the run did"
            f"{'' if final else ', without the final evaluation'}: cut short or replaced, so the metrics read "
            f"from it are unknown")


def no_summary(path: Path) -> str:
    """Why a run folder has no summary to report: none written yet (a run going on, as far as this
    machine can tell, or one that stopped), or one that is damaged."""
    if (path / SUMMARY).exists():
        return f"{SUMMARY} is damaged (not a JSON object)"
    if RunDir(path).lock_held():
        return f"no {SUMMARY} yet: running (a process on this machine holds its lock)"
    return f"no {SUMMARY}: unfinished or failed"
