"""The package's shape (docs/architecture.md): no import cycles, and each layer imports only from below.

Every import counts, those inside functions too (the CLI loads its subcommands on demand): a cycle
through a lazy import is still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "switchagg"

# The layers, lowest first: a module may import from its own layer's lower modules and from layers below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("wire", "errors", "transport", "scheduling", "netns"),  # the format, the errors, the sockets, the I/O
    # thread's policy, network namespaces (the loss, link and tree benches' and the BMv2 bed's)
    ("codec", "calls", "session", "window", "protocol", "diagnosis", "config", "tree", "jobs", "frames",
     "scapy_layer", "torch_payloads", "payloads"),  # sans-I/O core
    ("switch.records", "switch.model", "switch.native", "switch.control", "switch.control_client",
     "switch.server"),  # the switch: semantics, then the server around them
    ("targets.base", "targets.p4c", "targets.p4job", "targets.bfrt", "targets.tofino_build", "targets.soft",
     "targets.bmv2", "targets.tofino", "targets"),  # control planes
    ("client", "loopback", "torch_futures", "ddp", "distributed.options", "distributed.topology",
     "distributed.rendezvous", "distributed.hierarchy",
     "distributed.group", "distributed.fsdp", "distributed"),  # the worker's side
    ("worker", "demo", "ddp_demo", "benchmarks", "benchmarks.bmv2_vs_forwarding", "benchmarks.bmv2_instructions",
     "benchmarks.tasks", "benchmarks.loss", "benchmarks.links", "benchmarks.trees", "benchmarks.throughput",
     "benchmarks.training", "",
     "__main__", "switch"),  # programs
)


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in it except under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}".strip(".") for a in node.names} & known.keys()
            out |= subs if len(subs) == len(node.names) else {base}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            out |= {n.removeprefix("switchagg").strip(".") for n in names if n and n.split(".")[0] == "switchagg"}
    # The package a module lives in is imported before it anyway; that is no edge.
    return {m for m in out if m in known and m != name and not name.startswith(m + ".") and m != ""} - {name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_module_has_a_layer():
    placed = [m for layer in LAYERS for m in layer]
    assert sorted(placed) == sorted(modules()), "add the new module to LAYERS and to docs/architecture.md"


def test_no_import_cycles():
    g = graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(g[node]):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(g):
        visit(node, [])


def test_each_module_imports_only_from_below():
    rank = {m: (i, j) for i, layer in enumerate(LAYERS) for j, m in enumerate(layer)}
    upward = sorted(f"{m} imports {d}" for m, deps in graph().items() for d in deps
                    if rank[d][0] > rank[m][0] or (rank[d][0] == rank[m][0] and rank[d][1] > rank[m][1]))
    assert not upward, upward


def test_the_c_modules_include_only_headers_and_one_init_includes_the_others():
    sources = {p.name: p.read_text() for p in PACKAGE.glob("_*.c")}
    included = {name: {line.split('"')[1] for line in text.splitlines() if line.startswith('#include "')}
                for name, text in sources.items()}
    assert all(inc.endswith(".h") for incs in included.values() for inc in incs), included
    assert {"_codec.h", "_stream.h", "_switch.h"} <= included["_native.c"]
    assert not any("_native" in inc for incs in included.values() for inc in incs)
