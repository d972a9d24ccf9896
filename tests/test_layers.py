"""The package's folders are its layers (docs/architecture.md draws them; bench/layers.py measures
them): no import points up a layer, the engine hides no project import inside a function, the top
level holds the entry points and shared basics only, each layer's package says what it owns, the
configuration reads option declarations rather than the engine, and ``fedcp-partition`` loads no
training code."""
import ast
import importlib.util
import json
import subprocess
import sys

from conftest import REPO

PKG = REPO / "fedcp_dist"


def _layers():
    spec = importlib.util.spec_from_file_location("bench_layers", REPO / "bench" / "layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_points_up_a_layer_and_the_engine_hides_none():
    r = _layers().measure(PKG)
    assert r["up"] == []
    assert r["local_imports"] == []


def test_the_layer_table_sees_an_import_that_points_up():
    """The check can fail: a basic module importing the engine is reported."""
    layers = _layers()
    assert layers.layer("fedcp_dist.options") < layers.layer("fedcp_dist.fused.step") < layers.layer(
        "fedcp_dist.state.client_store") < layers.layer("fedcp_dist.algorithms.fedcp") < layers.layer(
        "fedcp_dist.config") < layers.layer("fedcp_dist.engine.simulator") < layers.layer("fedcp_dist.cli.partition")
    # the flat layout's names are measured in the same layers (its data.make imported config: one up);
    # spelt in two pieces, so that a rewrite of the flat layout's names (the relayout commit's) leaves them
    flat = "fedcp_dist" + "."
    assert layers.current(flat + "fused_groups") == "fedcp_dist.fused.groups"
    assert layers.current(flat + "fused") == "fedcp_dist.fused.slots"
    assert layers.current("fedcp_dist.fused.step") == "fedcp_dist.fused.step"


def test_the_top_level_holds_a_dozen_modules_at_most_and_each_layer_says_what_it_owns():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 12, top
    for package in ("engine", "fused", "state", "comm", "rundir"):
        tree = ast.parse((PKG / package / "__init__.py").read_text())
        doc = ast.get_docstring(tree)
        assert doc and len(doc) > 80, package  # a sentence or more on what it owns
        assert [type(n) for n in tree.body] == [ast.Expr], f"{package}/__init__.py imports nothing"


def _project_imports(path) -> set:
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("fedcp_dist")}


def test_config_reads_option_declarations_not_the_engine():
    """The config package imports the option machinery, the method registry, the models' choice and
    each layer's declarations (its keys module), nothing of the engine's code; its reading of config
    text (config/text.py) knows nothing of the keys."""
    imported = _project_imports(PKG / "config" / "__init__.py")
    assert imported == {"fedcp_dist.algorithms", "fedcp_dist.errors", "fedcp_dist.options", "fedcp_dist.models",
                        "fedcp_dist.engine.keys", "fedcp_dist.fused.keys", "fedcp_dist.state.keys",
                        "fedcp_dist.rundir.keys", "fedcp_dist.config.text"}
    assert _project_imports(PKG / "config" / "text.py") == {"fedcp_dist.errors"}
    imported -= {"fedcp_dist.config.text"}
    for name in imported - {"fedcp_dist.algorithms", "fedcp_dist.models"}:
        source = (REPO / (name.replace(".", "/") + ".py")).read_text()
        assert "import torch" not in source, name


def test_fedcp_partition_loads_no_training_code():
    """Importing the partition command (what ``fedcp-partition`` starts with) loads the data
    modules only: no method, no engine, no configuration, and neither torch nor its optimisers."""
    code = "import json, sys; import fedcp_dist.cli.partition; print(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = json.loads(r.stdout)
    ours = {m for m in loaded if m.startswith("fedcp_dist")}
    allowed = ("fedcp_dist.cli", "fedcp_dist.data", "fedcp_dist.errors", "fedcp_dist.fileio", "fedcp_dist.interrupts",
               "fedcp_dist.options")
    assert ours and all(m == "fedcp_dist" or m.startswith(allowed) for m in ours), sorted(ours)
    assert not {"torch", "torch.optim", "torch.nn", "torchvision"} & set(loaded)
