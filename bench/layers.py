"""The package's layers, measured: how deep its import graph goes, which imports point up a layer,
the engine's longest functions and its function-local imports of the project's own modules.

    python bench/layers.py [PACKAGE_DIR]      # default: this checkout's fedcp_dist/

A module's layer is the first entry of LAYERS its dotted name starts with (bottom first); an import
(at module level or inside a function) points up when the imported module sits in a higher layer than
the importer. A tree of the flat layout (before the packages) is measured under the same layers: its
module names are translated by FLAT_NAMES first. docs/architecture.md records the figures.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

#: bottom first; a module belongs to the first layer with a prefix its name starts with
LAYERS = (
    ("basics", ("fedcp_dist.options", "fedcp_dist.errors", "fedcp_dist.interrupts", "fedcp_dist.fileio", "fedcp_dist.losses",
                "fedcp_dist.runtime", "fedcp_dist.launch_env", "fedcp_dist.capabilities", "fedcp_dist.engine.keys", "fedcp_dist.fused.keys", "fedcp_dist.state.keys",
                "fedcp_dist.comm.keys", "fedcp_dist.rundir.keys")),
    ("models and data", ("fedcp_dist.models", "fedcp_dist.data")),
    ("local training", ("fedcp_dist.local_train", "fedcp_dist.fused")),
    ("state and communication", ("fedcp_dist.state", "fedcp_dist.comm")),
    ("methods", ("fedcp_dist.algorithms",)),
    ("configuration", ("fedcp_dist.config",)),
    ("the round and the run directory", ("fedcp_dist.engine", "fedcp_dist.rundir")),
    ("entry points and tools", ("fedcp_dist.run", "fedcp_dist.cli", "fedcp_dist.sweep", "fedcp_dist.analysis",
                                "fedcp_dist")),
)
#: the engine: what the longest-function and local-import figures cover
ENGINE = ("fedcp_dist.engine", "fedcp_dist.fused", "fedcp_dist.state", "fedcp_dist.comm", "fedcp_dist.rundir",
          "fedcp_dist.local_train", "fedcp_dist.config", "fedcp_dist.runtime")
#: the flat layout's top-level modules and where they are now
FLAT_NAMES = {
    "simulator": "engine.simulator", "run_start": "engine.run_start", "startup": "engine.startup",
    "training": "engine.training", "evaluation": "engine.evaluation", "round_record": "engine.round_record",
    "probes": "engine.probes", "fused": "fused.slots", "fused_forward": "fused.forward",
    "fused_groups": "fused.groups", "fused_memory": "fused.memory", "client_store": "state.client_store",
    "placement": "state.placement", "aggregate": "comm.aggregate", "compress": "comm.compress",
    "selection": "comm.selection", "rundir": "rundir.directory", "checkpoint": "rundir.checkpoint",
    "preemption": "rundir.preemption", "loggers": "rundir.loggers", "faults": "rundir.faults",
    "preflight": "engine.preflight", "privacy": "comm.privacy", "privacy_accounting": "comm.privacy_accounting",
}


def modules(root: Path) -> dict:
    """{dotted name: path} of every module under the package directory ``root``."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(name: str, path: Path, known: dict) -> list:
    """[(imported module, at module level?, line)] of ``name``'s imports of modules in ``known``, each once per statement."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body} | {id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try))
                                        for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                       for a in node.names]
        for t in targets:
            while t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known and t != name and not name.startswith(t + ".") and (t, id(node) in top, node.lineno) not in out:
                out.append((t, id(node) in top, node.lineno))
    return out


def layer(name: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise KeyError(name)


def current(name: str) -> str:
    """``name`` in today's layout (a flat-layout name translated)."""
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in FLAT_NAMES and not (len(parts) > 2 and parts[1] in ("fused", "rundir")):
        return ".".join(["fedcp_dist", FLAT_NAMES[parts[1]], *parts[2:]])
    return name


def depth(graph: dict) -> tuple:
    """(edges on the longest chain of module-level imports, that chain)."""
    memo: dict = {}

    def longest(m, stack=()):
        if m in memo:
            return memo[m]
        best = (0, [m])
        for t in sorted(graph[m]):
            if t in stack:
                continue
            d, chain = longest(t, stack + (m,))
            if d + 1 > best[0]:
                best = (d + 1, [m] + chain)
        memo[m] = best
        return best

    return max((longest(m) for m in sorted(graph)), key=lambda x: x[0])


def functions(name: str, path: Path) -> list:
    """[(lines, qualified name)] of every function and method in the module."""
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.end_lineno - child.lineno + 1, f"{name}.{prefix}{child.name}"))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()), "")
    return out


def measure(root: Path) -> dict:
    mods = modules(root)
    up, local, graph, every = [], [], {}, {}
    for name, path in mods.items():
        graph[name], every[name] = set(), set()
        for t, at_top, line in imports(name, path, mods):
            every[name].add(t)
            if at_top:
                graph[name].add(t)
            if layer(current(t)) > layer(current(name)):
                up.append(f"{name}:{line} -> {t}")
            if not at_top and current(name).startswith(ENGINE) and name != "fedcp_dist.run":
                local.append(f"{name}:{line} -> {t}")
    d, chain = depth(graph)
    d_all, _ = depth(every)
    funcs = sorted((f for name, path in mods.items() if current(name).startswith(ENGINE)
                    for f in functions(name, path)), reverse=True)
    return {"modules": len(mods), "top_level_modules": sum(1 for p in root.glob("*.py")), "depth": d,
            "depth_all": d_all, "chain": chain, "up": up, "local_imports": local, "longest": funcs[:5]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package", nargs="?", default=str(Path(__file__).resolve().parents[1] / "fedcp_dist"))
    args = p.parse_args(argv)
    r = measure(Path(args.package).resolve())
    print(f"modules: {r['modules']} ({r['top_level_modules']} at the top level)")
    print(f"import graph depth (module-level imports): {r['depth']}: {' -> '.join(r['chain'])}")
    print(f"import graph depth (every import, function-local ones too): {r['depth_all']}")
    print(f"imports pointing up a layer: {len(r['up'])}")
    for line in r["up"]:
        print(f"  {line}")
    print(f"function-local imports of the project's modules in the engine: {len(r['local_imports'])}")
    for line in r["local_imports"]:
        print(f"  {line}")
    print("longest functions in the engine:")
    for n, f in r["longest"]:
        print(f"  {n:4d} lines  {f}")
    return 0


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    sys.exit(cli_main(main)())
