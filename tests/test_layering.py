"""The package's import graph: no cycles, and the runtime depends on nothing above it.

The graph is read from the source with ``ast`` (no module is imported), counting imports inside
functions too: an import moved into a function to dodge a cycle still is that cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trtssd"

# What the runtime (rank 0's target loop, the draft rank) must never import, even indirectly:
# the user API, the command lines, benchmarks, the engine build, the servers (OpenAI, Triton), and
# text (the runtime deals in token ids only).
ABOVE_RUNTIME = ("trtssd.llm", "trtssd.bench", "trtssd.plan", "trtssd.cli", "trtssd.build", "trtssd.serving",
                 "trtssd.triton", "trtssd.text", "trtssd.engines")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The trtssd modules ``name`` imports, anywhere in its body. ``from X import y`` counts as an
    import of X.y when that is a module, else of X."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph: dict[str, set[str]], start: str, stop=lambda module: False) -> dict[str, str]:
    """Every module ``start`` imports, directly or not, mapped to the module that imports it
    (breadth first: the chains are the shortest). Modules where ``stop`` holds are not followed."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v]):
            if w not in via and w != start:
                via[w] = v
                if not stop(w):
                    todo.append(w)
    return via


def _chain(via: dict[str, str], start: str, end: str) -> str:
    path = [end]
    while path[-1] != start:
        path.append(via[path[-1]])
    return " -> ".join(reversed(path))


def _is_above(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in ABOVE_RUNTIME)


def test_graph_sees_the_package():
    graph = import_graph()
    assert "trtssd.runtime.draft_worker" in graph
    assert "trtssd.backends.base" in graph["trtssd.runtime.draft_worker"]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles in trtssd/: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_cycles_between_packages():
    """trtssd.models, .backends, .kernels, .runtime, ... as units: one may use another only one way."""
    graph: dict[str, set[str]] = {}
    for module, imported in import_graph().items():
        graph.setdefault(_package(module), set()).update(_package(m) for m in imported if _package(m) != _package(module))
    found = cycles(graph)
    assert not found, "import cycles between packages: " + "; ".join(" <-> ".join(c) for c in found)


def _package(module: str) -> str:
    """trtssd.models.llama -> trtssd.models; top-level modules (trtssd.llm) are their own unit."""
    return ".".join(module.split(".")[:2])


def test_runtime_imports_nothing_above_it():
    graph = import_graph()
    bad = []
    for module in sorted(m for m in graph if m.startswith("trtssd.runtime")):
        via = reachable(graph, module, stop=_is_above)
        bad += [_chain(via, module, up) for up in sorted(via) if _is_above(up)]
    assert not bad, "the runtime imports code above it:\n" + "\n".join(bad)


# Where the runtime may read an attribute by name: a record's own fields (a dataclass walking
# its fields). Anything else, an executor above all, is asked through its declared contract.
NAMED_ATTRIBUTE_OWNERS = ("self", "other")


def _named_attribute_reads(path: Path) -> list[str]:
    """getattr/hasattr calls of a module whose object is not one of NAMED_ATTRIBUTE_OWNERS, and
    every ``__getattr__`` it defines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            found.append(f"{path.name}:{node.lineno} defines __getattr__")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in NAMED_ATTRIBUTE_OWNERS)):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_runtime_reads_executors_through_their_contract():
    """What an executor can do is declared on the protocol (`ExecutorCapabilities`,
    trtssd/backends/base.py): the runtime never probes attributes, and no executor forwards
    unknown ones."""
    found = [hit for path in sorted((PACKAGE / "runtime").glob("*.py")) for hit in _named_attribute_reads(path)]
    found += [hit for path in sorted((PACKAGE / "backends").glob("*.py")) for hit in _named_attribute_reads(path)
              if "__getattr__" in hit]
    assert not found, "attributes read by name in trtssd/runtime:\n" + "\n".join(found)
