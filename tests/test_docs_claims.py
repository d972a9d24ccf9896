"""What the README and the documentation claim, checked against the code and against each other.

Mechanical checks only: every command shown in a shell block names a tool that exists and flags and
config keys that tool accepts; every repository file, test and sweep the pages name exists; the
README keeps exactly its two set-up-free commands; the status box names the same GPU figures as the
performance table; the reproduction page's paper cells are the Paper settings page's published table and
its own cells are figures the Results pages measured. Each checker is also run on a made-up page
that breaks it, so the checks can fail."""
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import REPO
from fedcp_dist.cli import config_reference

DOCS = REPO / "docs"
#: the pages a reader is pointed to, and the archive that keeps each study as it was written (its
#: commands must still run; its prose keeps the keys of its day)
PAGES = sorted(p for p in DOCS.glob("*.md"))
ARCHIVE = sorted((DOCS / "archive").glob("*.md"))
README = REPO / "README.md"

#: command name -> module whose ``main`` builds its parser (setup.py's console scripts)
TOOLS = {"fedcp-run": "fedcp_dist.run", "fedcp-partition": "fedcp_dist.cli.partition",
         "fedcp-sweep": "fedcp_dist.cli.sweep", "fedcp-report": "fedcp_dist.cli.report",
         "fedcp-analyze": "fedcp_dist.cli.analyze", "fedcp-dlg": "fedcp_dist.cli.analyze:main_dlg"}
#: tools that take ``key=value`` config overrides after their flags
OVERRIDES = {"fedcp-run", "fedcp_dist.run"}


def test_the_console_scripts_are_the_tools_checked_here():
    text = (REPO / "setup.py").read_text(encoding="utf-8")
    scripts = dict(re.findall(r'"(fedcp-[a-z]+)=([\w.]+:\w+)"', text))
    assert {k: v if v.endswith(":main_dlg") else v.split(":")[0] for k, v in scripts.items()} == TOOLS


def _help(target: str) -> str:
    module, _, func = target.partition(":")
    main = getattr(importlib.import_module(module), func or "main")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return out.getvalue()


#: the benchmark scripts, which pages show as ``python bench/NAME.py`` or under a launcher
BENCH = sorted(f"bench/{f.name}" for f in (REPO / "bench").glob("*.py"))


def _bench_help(script: str) -> str:
    spec = importlib.util.spec_from_file_location(f"docs_{Path(script).stem}", REPO / script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        mod.main(["--help"])
    return out.getvalue()


@pytest.fixture(scope="module")
def helps():
    return {**{name: _help(target) for name, target in TOOLS.items()},
            **{script: _bench_help(script) for script in BENCH}}


def takes_overrides(tool: str, helps: dict) -> bool:
    """Whether ``tool`` takes ``key=value`` config overrides: fedcp-run, and the benchmarks whose
    usage ends in ``[overrides ...]``."""
    return tool in OVERRIDES or tool == "fedcp-run" or "overrides ..." in helps.get(tool, "")


def shell_commands(text: str) -> list:
    """The command lines of a page's shell blocks (fenced sh/bash/console, or indented by four
    spaces), continuation lines joined and comments dropped."""
    lines, out, indented = [], [], set()
    fenced = re.findall(r"^```(?:sh|bash|shell|console)\n(.*?)^```", text, flags=re.M | re.S)
    for block in fenced:
        lines += block.splitlines()
    in_fence = False
    for line in text.splitlines():  # indented blocks outside fences
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("    ") and not line.lstrip().startswith(("|", "-", "*")):
            lines.append(line[4:])
            indented.add(line[4:])
    joined = ""
    for line in lines:
        if line in indented and not COMMAND.match(line):
            continue  # an indented line of prose or a formula, not a command
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        joined += line
        if joined.strip():
            out.append(joined.strip())
        joined = ""
    return out


#: how an indented command line starts (an environment assignment, then a tool or launcher)
COMMAND = re.compile(r"\s*(?:[A-Z_]+=\S+\s+)*(?:fedcp-|python|torchrun|mpirun|srun|sbatch|make|bash|nice)")


def tool_of(words: list):
    """(tool, index of its first argument) of a command line, or (None, 0) for any other command."""
    for i, w in enumerate(words):
        if w in TOOLS:
            return w, i + 1
        if re.fullmatch(r"(?:\./)?bench/\w+\.py", w):
            return w.removeprefix("./"), i + 1
        if w == "-m" and i + 1 < len(words) and words[i + 1] in ("fedcp_dist.run", "fedcp_dist.cli.config_reference"):
            return words[i + 1], i + 2
    return None, 0


def command_problems(command: str, helps: dict, keys: set) -> list:
    """What a command line names that its tool does not accept: an unknown flag, or a ``key=value``
    override of a key the config has not."""
    try:
        words = shlex.split(command)
    except ValueError as err:
        return [f"{command!r} does not parse: {err}"]
    tool, start = tool_of(words)
    if tool is None:
        return []
    if tool.startswith("bench/") and tool not in helps:
        return [f"no benchmark {tool} ({command})"]
    text = helps.get(tool) or helps.get({"fedcp_dist.run": "fedcp-run"}.get(tool, ""), "")
    if tool == "fedcp_dist.cli.config_reference":
        text = "--check --out"
    problems = []
    for w in words[start:]:
        if w in ("|", "&&", ";", ">", "2>&1"):
            break
        flag = w.split("=", 1)[0]
        if flag.startswith("--") and not re.search(re.escape(flag) + r"\b", text):
            problems.append(f"{tool} has no flag {flag} ({command})")
        if takes_overrides(tool, helps) and re.fullmatch(r"[a-z_]+(\.[a-z_]+)?=.*", w) \
                and w.split("=", 1)[0] not in keys:
            problems.append(f"no config key {w.split('=', 1)[0]!r} ({command})")
    return problems


@pytest.fixture(scope="module")
def keys():
    return set(config_reference.keys())


@pytest.mark.parametrize("page", [README, *PAGES, *ARCHIVE], ids=lambda p: p.name)
def test_every_command_shown_takes_the_flags_and_keys_it_is_given(page, helps, keys):
    problems = [p for c in shell_commands(page.read_text(encoding="utf-8")) for p in command_problems(c, helps, keys)]
    assert not problems, "\n".join(problems)


def test_the_pages_show_commands_of_every_tool():
    seen = set()
    for page in [README, *PAGES, *ARCHIVE]:
        for command in shell_commands(page.read_text(encoding="utf-8")):
            with contextlib.suppress(ValueError):
                seen.add(tool_of(shlex.split(command))[0])
    assert set(TOOLS) | {"fedcp_dist.run"} <= seen, set(TOOLS) - seen


def test_the_command_checker_finds_a_wrong_flag_and_a_wrong_key(helps, keys):
    page = ("```sh\nfedcp-run --config configs/digits_fedcp.yaml rounds=5 no_such_key=1\n"
            "fedcp-partition --source digits --no-such-flag 3 \\\n    --out x.h5\n```\n")
    problems = [p for c in shell_commands(page) for p in command_problems(c, helps, keys)]
    assert any("no_such_key" in p for p in problems) and any("--no-such-flag" in p for p in problems), problems
    assert not command_problems("fedcp-run --config configs/digits_fedcp.yaml rounds=5 data.path=x.h5", helps, keys)
    # the benchmarks: their flags, the overrides of those that take them, and the script itself
    bench = ("```sh\ntorchrun --nproc_per_node=2 bench/round.py --compare --no-such-flag rounds=1 no_such_key=2\n"
             "python bench/nosuch.py --x\npython bench/kernels.py --split\n```\n")
    problems = [p for c in shell_commands(bench) for p in command_problems(c, helps, keys)]
    assert sorted(problems) == sorted([
        "bench/round.py has no flag --no-such-flag (torchrun --nproc_per_node=2 bench/round.py --compare --no-such-flag "
        "rounds=1 no_such_key=2)",
        "no config key 'no_such_key' (torchrun --nproc_per_node=2 bench/round.py --compare --no-such-flag rounds=1 "
        "no_such_key=2)",
        "no benchmark bench/nosuch.py (python bench/nosuch.py --x)"]), problems


def inline_keys(text: str) -> set:
    """Config keys set inline in prose: `key=value` and `key: value` in backticks, where the key is
    written as config keys are (lower case, underscores, an optional ``data.``)."""
    found = set(re.findall(r"`((?:data\.)?[a-z][a-z0-9]*(?:_[a-z0-9]+)+|data\.[a-z_]+)=[^`\s]*`", text))
    found |= set(re.findall(r"`((?:data\.)?[a-z][a-z0-9]*(?:_[a-z0-9]+)+): [^`]+`", text))
    return found


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_config_key_set_in_the_text_exists(page, keys):
    unknown = inline_keys(page.read_text(encoding="utf-8")) - keys - ALSO_INLINE
    assert not unknown, f"{page.name} sets keys the config has not: {sorted(unknown)}"


#: `name: value` / `name=value` spans that are not config keys: a sweep file's or a summary's
#: fields, a partition block's keys, and the start line's wording
ALSO_INLINE = {"participation_range", "partition_params", "include_val", "train_images", "val_images",
               "array_parallelism", "gpus_per_task", "tasks_per_node", "cpus_per_task", "time_min",
               "num_clients", "text_pipeline", "selection_counts", "uplink_bytes", "best_acc", "final_acc",
               "peak_rss_mb", "rss_mb", "rss_anon_mb", "client_state_held_mb", "train_cpu_seconds",
               "uplink_bytes_sent", "n_diverged", "max_len", "vocab_size", "min_freq", "image_size",
               "label_col", "client_col", "synthetic_alpha", "synthetic_beta", "dp_guarantee",
               # library arguments the pages quote (TensorBoard's writer, torch.load), and the key the
               # contributing guide's worked example declares
               "purge_step", "weights_only", "fedls_eps"}


def test_the_inline_key_checker_finds_an_unknown_key(keys):
    assert inline_keys("set `fused_group: 4` and `cpn_hiden=64`") - keys == {"cpn_hiden"}


#: repository paths a page may name: configs, benchmarks, tests, the package's modules, scripts
PATH = re.compile(r"(?<![\w/.-])((?:configs|bench|tests|fedcp_dist|slurm|launch)/[\w./-]*\w\.(?:yaml|py|sh|sbatch|json))")
TEST_ID = re.compile(r"(tests/test_\w+\.py)::(\w+)")


def missing_paths(text: str) -> list:
    out = [p for p in set(PATH.findall(text)) if "<" not in p and "*" not in p and not (REPO / p).exists()]
    for path, name in set(TEST_ID.findall(text)):
        file = REPO / path
        if not file.is_file() or name not in {n.name for n in ast.walk(ast.parse(file.read_text(encoding="utf-8")))
                                              if isinstance(n, ast.FunctionDef)}:
            out.append(f"{path}::{name}")
    return out


#: files the pages name as what a tool writes, or that the contributing guide's worked example has the
#: reader create, not as files of the repository
WRITTEN = {"bench/last.json", "configs/digits_fedls.yaml", "fedcp_dist/algorithms/fedls.py"}


def expand_braces(text: str) -> str:
    """`configs/x_n{10,30}of50.yaml` names `configs/x_n10of50.yaml` and `configs/x_n30of50.yaml`."""
    return re.sub(r"(\S*)\{([\w.,]+)\}(\S*)", lambda m: " ".join(m.group(1) + a + m.group(3) for a in m.group(2).split(",")), text)


@pytest.mark.parametrize("page", [README, *PAGES, *ARCHIVE], ids=lambda p: p.name)
def test_every_repository_file_and_test_named_exists(page):
    text = page.read_text(encoding="utf-8")
    text = expand_braces(text)
    missing = sorted(set(missing_paths(text)) - WRITTEN)
    assert not missing, f"{page.name} names files or tests that do not exist: {missing}"


def test_the_path_checker_finds_a_missing_file_and_test():
    text = "see `configs/no_such.yaml` and `tests/test_config_reference.py::test_no_such_test`"
    assert sorted(missing_paths(text)) == ["configs/no_such.yaml", "tests/test_config_reference.py::test_no_such_test"]
    assert not missing_paths("`configs/digits_fedcp.yaml`, tests/test_config_reference.py::test_check_mode_reports_a_stale_page")


def test_the_readme_keeps_two_setup_free_commands_that_the_makefile_has():
    text = README.read_text(encoding="utf-8")
    commands = shell_commands(text)
    assert commands == ["make run", "make test"], commands
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(encoding="utf-8"), flags=re.M))
    assert {"run", "test"} <= targets
    # short, pointing to the documentation
    assert len(text.splitlines()) < 100 and "docs/index.md" in text
    for link in re.findall(r"\]\(((?!http)[^)#]+)", text):
        assert (REPO / link).exists(), link


GPU = ("29.66", "5.52")


def test_the_status_boxes_agree_with_the_performance_table():
    perf = (DOCS / "performance.md").read_text(encoding="utf-8")
    rows = [line for line in perf.splitlines() if line.startswith("| MNIST | 1 NVIDIA H200")]
    assert [r.split("|")[5].strip() for r in rows] == ["29.66", "5.52", "4.92"]
    for page in (README, DOCS / "index.md"):
        text = page.read_text(encoding="utf-8")
        box = text[text.index("| verified"):]
        box = box[:box.index("\n\n")]
        assert all(f in box for f in GPU), page.name
        assert "**not verified**" in box and "GPU" in box.split("**not verified**", 1)[1]
        assert re.search(r"CIFAR-10.*Tiny-ImageNet.*AG News", box)
    # what the box says of the GPU tests is what the cluster page says: one H200 sitting, at the
    # commit the performance page names, and the checks written since not run on a GPU
    cluster = " ".join((DOCS / "cluster.md").read_text(encoding="utf-8").split())
    sitting = re.search(r"Once, on one NVIDIA H200 at commit ([0-9a-f]{7})", cluster)
    assert sitting and f"H200 at commit {sitting.group(1)}" in " ".join(perf.split())
    assert "have not run on a GPU" in cluster.split("What has run on a GPU", 1)[1]
    assert "ran once, on one H200" in (DOCS / "index.md").read_text(encoding="utf-8")
    # no page promises bit-identical GPU runs without saying they are unchecked
    for page in [README, *PAGES]:
        for sentence in re.split(r"(?<=[.;])\s", " ".join(page.read_text(encoding="utf-8").split())):
            if re.search(r"same kind of GPU", sentence):
                assert re.search(r"not (yet )?(been )?checked|not verified|design", sentence), (page.name, sentence)


def _table(text: str, header_start: str) -> list:
    """The rows of the first markdown table whose header starts with ``header_start``, as cell lists."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


NUMBER = re.compile(r"\d+\.\d+(?: ± \d+\.\d+)?")


def test_the_reproduction_page_sets_the_published_table_beside_measured_figures():
    page = (DOCS / "reproduction.md").read_text(encoding="utf-8")
    methods = (DOCS / "paper-settings.md").read_text(encoding="utf-8")
    published = {r[0]: r[1:] for r in _table(methods, "| method | pathological MNIST |")}
    mnist = _table(page, "| method | pathological, paper |")
    cifar = _table(page, "| method | pathological, paper | Dir(0.1), paper | ours |")
    assert len(mnist) == len(cifar) == len(published) == 12
    for row in mnist:  # the paper's cells are the Paper settings page's published table
        assert [row[1], row[3]] == [published[row[0]][0], published[row[0]][2]], row[0]
    for row in cifar:
        assert [row[1], row[2]] == [published[row[0]][1], published[row[0]][3]], row[0]
    # every figure this project measured is in a row of the same method in a table of the Results
    # page or its log ...
    measured = (DOCS / "results.md").read_text(encoding="utf-8") + (DOCS / "archive" / "results-log.md").read_text(encoding="utf-8")
    rows = [line for line in measured.splitlines() if line.startswith("| ")]
    log = (DOCS / "archive" / "results-log.md").read_text(encoding="utf-8")
    beside = _table(log, "| after round | FedPer, library |")
    header = next(line for line in log.splitlines() if line.startswith("| after round | FedPer, library |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    best = {c: max(float(r[i]) for r in beside) for i, c in enumerate(columns) if i}
    # ... but the pathological baselines', the best of their run beside the reference library
    from_library = {"FedPer": "FedPer, ours", "FedRep": "FedRep 10, ours", "Ditto": "Ditto, ours"}
    checked = 0
    for row in mnist:
        method = row[0]
        for cell in (row[2], row[4]):
            for figure in NUMBER.findall(cell.split("(")[0] + ";" + ";".join(re.findall(r"\); ([^(]+)\(", cell))):
                if cell is row[2] and method in from_library:
                    assert float(figure) == best[from_library[method]], (method, figure)
                else:
                    assert any(r.startswith(f"| {method}") and figure in r for r in rows), (method, figure)
                checked += 1
    assert checked >= 14
    # a Dir(0.1) cell of 50 or more rounds is the Results page's summary row of that method and budget
    glance = {(r[1], r[4]): r[3] for r in _table(measured, "| setting | method | paper") if r[0].startswith("MNIST, 20 clients, Dir")}
    summarised = 0
    for row in mnist:
        for figure, rounds in re.findall(r"(\d+\.\d\d(?: ± \d+\.\d\d)?) \((\d+) rounds", row[4]):
            if int(rounds) >= 50:
                assert glance[(row[0], rounds)] == figure, (row[0], rounds, figure)
                summarised += 1
    assert summarised == 6
    # the library's own best of those runs, as the page quotes them
    assert "which reached 99.19 (FedPer), 99.55 (FedRep, 10 head epochs) and\n99.34 % (Ditto)" in page
    assert [best["FedPer, library"], best["FedRep 10, library"], best["Ditto, library"]] == [99.19, 99.55, 99.34]


def test_every_transcribed_table_is_whole_and_agrees_with_the_methods_page():
    page = (DOCS / "reproduction.md").read_text(encoding="utf-8")
    cell = re.compile(r"\d+\.\d\d ± \d+\.\d\d|—|diverged")
    tables = {h: _table(page, h) for h in ("| method | pathological CIFAR-100, paper |", "| method | TINY (4-layer CNN), paper |",
                                           "| method | N = 10 |", "| method | N = 10 of 50 |", "| method | E = 5 |",
                                           "| method | ρ = 1 |")}
    for header, rows in tables.items():
        assert [r[0] for r in rows][-1] == "FedCP" and len(rows) in (10, 12), header
        assert all(cell.fullmatch(c) for r in rows for c in r[1:]), header
    cifar100 = {r[0]: r[1:] for r in tables["| method | pathological CIFAR-100, paper |"]}
    tiny = {r[0]: r[1:] for r in tables["| method | TINY (4-layer CNN), paper |"]}
    scale = {r[0]: r[1:] for r in tables["| method | N = 10 |"]}
    subset = {r[0]: r[1:] for r in tables["| method | N = 10 of 50 |"]}
    # the figures the Paper settings page quotes from the same slide
    methods = " ".join((DOCS / "paper-settings.md").read_text(encoding="utf-8").split())
    assert "CIFAR-100 Dir(0.1) the paper reports FedCP 59.56 % against Ditto 52.87 %" in methods
    assert cifar100["FedCP"][1].startswith("59.56") and cifar100["Ditto"][1].startswith("52.87")
    assert "44.18 % against FedRep's 39.95 %" in methods
    assert tiny["FedCP"][1].startswith("44.18") and tiny["FedRep"][1].startswith("39.95")
    assert "**96.78 ± 0.09** for FedCP" in methods and "FedAvg 79.57, FedRep 96.28, Ditto 95.45" in methods
    assert tiny["FedCP"][2] == "96.78 ± 0.09" and [tiny[m][2][:5] for m in ("FedAvg", "FedRep", "Ditto")] == ["79.57", "96.28", "95.45"]
    # the subset table's N = 50 column is the scalability table's, as the page says
    assert all(subset[m][2] == scale[m][2] for m in subset)


def test_the_results_summary_repeats_the_detailed_tables():
    results = (DOCS / "results.md").read_text(encoding="utf-8")
    glance = _table(results, "| setting | method | paper")
    body = results[results.index("## Every method on the digits set"):] + (DOCS / "archive" / "results-log.md").read_text(encoding="utf-8")
    methods = (DOCS / "paper-settings.md").read_text(encoding="utf-8")
    checked = 0
    for row in glance:
        for figure in NUMBER.findall(row[3].split("(")[0]):
            assert figure in body, (row, figure)
            checked += 1
        for figure in NUMBER.findall(row[2]):
            assert figure in methods, (row, figure)
            checked += 1
    assert checked >= 20


def test_the_digits_table_is_the_committed_report_of_its_runs():
    """The headline digits table's best and final cells are fedcp-report's report.csv of the sweep
    (committed under docs/reports/), rounded as the page rounds them; the summary row's range too."""
    import csv

    results = (DOCS / "results.md").read_text(encoding="utf-8")
    rows = {r[0]: r for r in _table(results, "| method | best accuracy (%) | final accuracy, after round 50")}
    names = {"fedavg": "FedAvg", "fedprox": "FedProx", "perfedavg": "Per-FedAvg", "pfedme": "pFedMe",
             "fedamp": "FedAMP", "ditto": "Ditto", "fedper": "FedPer", "fedrep": "FedRep", "fedrod": "FedRoD",
             "fedfomo": "FedFomo", "fedphp": "FedPHP", "fedcp": "FedCP"}
    bests = []
    for column, metric in ((1, "best_acc"), (2, "final_acc")):
        with open(DOCS / "reports" / f"digits_methods_{metric}.csv", newline="") as f:
            report = list(csv.DictReader(f))
        assert sorted(r["method"] for r in report) == sorted(names) and len(rows) == 12
        for r in report:
            assert r["n_seeds"] == "3" and r["seeds"] == "1 2 3", r
            cell = f"{float(r['mean']):.2f} ± {float(r['std']):.2f}"
            assert rows[names[r["method"]]][column] == cell, (r["method"], metric, cell)
            if metric == "best_acc" and r["method"] != "fedcp":
                bests.append(float(r["mean"]))
    glance = next(r for r in _table(results, "| setting | method | paper") if r[1] == "the other 11 methods")
    assert glance[3].startswith(f"{min(bests):.2f} – {max(bests):.2f}")


def test_the_license_is_mit_and_setup_says_so():
    assert (REPO / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    assert 'license="MIT"' in (REPO / "setup.py").read_text(encoding="utf-8")


def test_the_changelog_page_includes_the_changelog_and_the_api_page_names_real_objects():
    assert '--8<-- "CHANGELOG.md"' in (DOCS / "changelog.md").read_text(encoding="utf-8")
    for target in re.findall(r"^::: ([\w.]+)", (DOCS / "api.md").read_text(encoding="utf-8"), flags=re.M):
        module, _, name = target.rpartition(".")
        try:
            obj = importlib.import_module(target)
        except ImportError:
            obj = getattr(importlib.import_module(module), name, None)
        assert obj is not None, target


def test_the_models_page_and_getting_started_name_every_model():
    """`model: lstm` (LEAF's Shakespeare) had no row on the Models page, and Getting started's key
    table listed the models without it."""
    from fedcp_dist.models import MODELS

    rows = (DOCS / "models.md").read_text(encoding="utf-8")
    start = next(line for line in (DOCS / "index.md").read_text(encoding="utf-8").splitlines()
                 if line.startswith("| `model` |"))
    for name in MODELS:
        assert f"\n| `{name}` |" in rows, name
        assert f"`{name}`" in start, name
