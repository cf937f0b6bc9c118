"""The package's layering, read from its source: no import cycle, and each layer imports only
what lies below it (STYLE.md: "nothing below imports anything above"; "core never imports a
framework").

Every module of `agentcache/` is parsed with `ast`; every import counts, wherever it is written
(module level, under `if TYPE_CHECKING:`, inside a function), and so does a string that names an
`agentcache` module whole (`"agentcache.scout.policies:SurvivalPolicy"`, what `importlib` loads).

What an edge is: `import a.b.c` and `from a.b.c import x` lead to `a.b.c`; `from a.b import c`
leads to the submodule `a.b.c` when there is one, else to the package `a.b` (its `__init__`).
Importing a submodule also runs its packages' `__init__`s first, but that implicit step is no
edge: a package `__init__` importing its own submodules is no cycle. A submodule that imports
its package by name (`from agentcache.engine import X`) does lean on that `__init__`, and when
the `__init__` imports the submodule back that is a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "agentcache"
PACKAGE = "agentcache"

# layer -> layers it must not import (a layer is a module or package and everything under it)
FORBIDDEN = {
    "agentcache.engine": ("agentcache.scout", "agentcache.correction", "agentcache.runtime", "agentcache.calls"),
    "agentcache.scout": ("agentcache.correction",),
    "agentcache.correction": ("agentcache.scout",),
}
FRAMEWORKS = ("autogen", "autogen_agentchat", "autogen_core", "autogen_ext", "langgraph", "langchain",
              "langchain_core", "langchain_community")
# what imports a framework in turn: the adapters (each a package of its own in integrations/) and the samples
# (agentcache_samples, a package of its own too)
ADAPTERS = tuple(sorted(p.parent.name for p in (ROOT.parent / "integrations").glob("*/__init__.py"))) + (
    "agentcache_samples",)
# Known framework imports still to move out of core: each must still occur (remove it here once it is
# gone), and no other may appear. `agentcache demo` and `agentcache trace record` run the LangGraph sample.
KNOWN_FRAMEWORK_IMPORTS = {
    "agentcache.cli imports agentcache_langgraph",
    "agentcache.cli imports langgraph",
    "agentcache.cli imports agentcache_samples",
}


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its `__init__`)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join([package, *parts])] = path
    return names


def _within(name: str, layer: str) -> bool:
    return name == layer or name.startswith(layer + ".")


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module of ours `target` names: itself, or the nearest module above it."""
    while target:
        if target in modules:
            return target
        target, _, _ = target.rpartition(".")
    return None


def _dotted_string(node: ast.AST) -> str | None:
    """A string constant that is nothing but an agentcache module path (with an optional `:attr`)."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return None
    module = node.value.partition(":")[0]
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return None
    return module


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules of ours, top-level names of everything else) that module `name` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]  # the package relative imports start from
    ours: set[str] = set()
    others: set[str] = set()

    def add(target: str) -> None:
        if _within(target, PACKAGE):
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != name:
                ours.add(resolved)
        else:
            others.add(target.partition(".")[0])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in modules else source)
        else:
            module = _dotted_string(node)
            if module is not None:
                add(module)
    return ours, others


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = module_names(root, package)
    graph, external = {}, {}
    for name, path in modules.items():
        graph[name], external[name] = imports_of(name, path, modules)
    return graph, external


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle
    through it, so a report names the modules to untangle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(root: str) -> None:  # iterative: a deep chain must not hit the recursion limit
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, set(component)) for component in sorted(components)]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return sorted(component)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for name, targets in sorted(graph.items()):
        for layer, forbidden in FORBIDDEN.items():
            if _within(name, layer):
                found += [f"{name} imports {t}" for t in sorted(targets) if any(_within(t, f) for f in forbidden)]
    return found


def framework_imports(external: dict[str, set[str]]) -> list[str]:
    banned = set(FRAMEWORKS) | set(ADAPTERS)
    return [f"{name} imports {lib}" for name, libs in sorted(external.items()) for lib in sorted(libs & banned)]


# --- the package -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return import_graph()


def test_no_import_cycle(package_graph):
    graph, _ = package_graph
    found = cycles(graph)
    assert not found, "import cycles (type-only and function-level imports included):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found)


def test_layers_import_only_downward(package_graph):
    graph, _ = package_graph
    found = layer_violations(graph)
    assert not found, "imports across layers:\n" + "\n".join(found)


def test_core_imports_no_framework(package_graph):
    _, external = package_graph
    found = set(framework_imports(external))
    new, fixed = sorted(found - KNOWN_FRAMEWORK_IMPORTS), sorted(KNOWN_FRAMEWORK_IMPORTS - found)
    assert not new, "core imports a framework or an adapter (adapters live in integrations/):\n" + "\n".join(new)
    assert not fixed, "no longer imported: remove from KNOWN_FRAMEWORK_IMPORTS:\n" + "\n".join(fixed)


# --- the checks themselves, on a package made up for them ---------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "agentcache" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "agentcache"


def test_checks_see_every_kind_of_import(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "from agentcache.engine import Engine\n",
        "engine/__init__.py": "from agentcache.engine.blocks import Pool\nfrom . import eviction\n",
        "engine/blocks.py": "from .eviction import Policy\n",
        "engine/eviction.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from agentcache.engine.blocks import Block\n"
            "POLICIES = {'survival': 'agentcache.scout.policies:SurvivalPolicy'}\n"
            "def f():\n    import langgraph.graph\n"
        ),
        "scout/__init__.py": "",
        "scout/policies.py": "from agentcache.engine import eviction\nfrom agentcache.correction.store import x\n",
        "correction/__init__.py": "",
        "correction/store.py": "",
    })
    graph, external = import_graph(root)
    assert graph["agentcache.engine"] == {"agentcache.engine.blocks", "agentcache.engine.eviction"}
    assert graph["agentcache.scout.policies"] == {"agentcache.engine.eviction", "agentcache.correction.store"}
    assert cycles(graph) == [["agentcache.engine.blocks", "agentcache.engine.eviction", "agentcache.engine.blocks"]]
    assert layer_violations(graph) == [
        "agentcache.engine.eviction imports agentcache.scout.policies",
        "agentcache.scout.policies imports agentcache.correction.store",
    ]
    assert framework_imports(external) == ["agentcache.engine.eviction imports langgraph"]


def test_a_package_importing_its_submodules_is_no_cycle_unless_one_imports_it_back(tmp_path):
    files = {
        "__init__.py": "",
        "engine/__init__.py": "from agentcache.engine.embedded import Engine\n",
        "engine/embedded.py": "from agentcache.engine.kv import Layout\n",
        "engine/kv.py": "",
    }
    graph, _ = import_graph(_write(tmp_path / "a", files))
    assert cycles(graph) == []
    files["engine/kv.py"] = "def f():\n    from agentcache.engine import Engine\n"
    graph, _ = import_graph(_write(tmp_path / "b", files))
    assert cycles(graph) == [["agentcache.engine", "agentcache.engine.embedded", "agentcache.engine.kv",
                              "agentcache.engine"]]
