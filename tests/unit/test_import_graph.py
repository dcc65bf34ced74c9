"""The package's import graph, read from the `ast` of every module (function-level imports counted), holds
ARCHITECTURE.md's layout rule: the top level is orchestration (flows/, deployments/), the stages (stages/) and I/O
(io/); slimeflow/ holds the libraries they use. A library never imports a stage, io/ imports no stage, a stage never
imports another stage, nothing but the entry points (the CLI, deployments/) imports flows/, and no two modules import
each other, directly or round a circle. Imports under `if TYPE_CHECKING:` never run and are not counted.
"""

from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

from paths import ROOT

STAGES = "slimeflow.stages"

# No exceptions are listed: evaluate and train share the rollout and engine libraries (slimeflow/rollout/, engine/),
# train's inline preprocessing runs the preprocess library (slimeflow/preprocess/), the RL math and the backends are
# a library (slimeflow/train/), and every stage's config lives in slimeflow/config/.
ENTRY_POINTS = ("slimeflow.cli",)
ORCHESTRATION = ("slimeflow.flows", "slimeflow.deployments")


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's __init__), by pyproject's package-dir."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in dirs.items():
        for file in (ROOT / folder).rglob("*.py"):
            parts = list(file.relative_to(ROOT / folder).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            found[".".join([package, *parts[:-1 if is_init else None]])] = (file, is_init)
    return found


def _known(name: str) -> str | None:
    """`name`, or the nearest enclosing module that exists (`from pkg.mod import attr` -> pkg.mod)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, at any depth (function bodies too), except under `if TYPE_CHECKING:`: those imports never run."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _imported(module: str) -> set[str]:
    file, is_init = modules()[module]
    package = module if is_init else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in _runtime_nodes(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            found |= {_known(alias.name) for alias in node.names if alias.name.startswith("slimeflow")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base.startswith("slimeflow"):
                found |= {_known(f"{base}.{alias.name}") for alias in node.names}
    return {name for name in found if name and name != module}


@cache
def graph() -> dict[str, set[str]]:
    return {module: _imported(module) for module in modules()}


def _stage(module: str) -> str | None:
    """The stage a module belongs to (`rl` for slimeflow.train.backends.torch.checkpoint); None outside the stages."""
    parts = module.split(".")
    if module.startswith(STAGES + ".") and len(parts) > 3:
        return parts[2]
    is_stage_package = len(parts) == 3 and modules()[module][1]
    return parts[2] if module.startswith(STAGES + ".") and is_stage_package else None


def _short(module: str) -> str:
    return module.removeprefix(STAGES + ".")


def _cycles() -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    edges, index, low, on_stack, stack, found = graph(), {}, {}, set(), [], []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _layer(module: str) -> str:
    """flows / stages / io / library: the layer of ARCHITECTURE.md's rule that a module sits in."""
    if module.startswith(ORCHESTRATION) or module in ENTRY_POINTS:
        return "orchestration"
    if module == STAGES or module.startswith(STAGES + "."):
        return "stages"
    if module == "slimeflow.io" or module.startswith("slimeflow.io."):
        return "io"
    return "library"


def test_the_graph_sees_the_imports_it_must():
    """The reader itself: a module-level, a function-level, a relative and a `from package import module` import."""
    edges = graph()
    assert "slimeflow.checkpoint.torch_dist" in edges["slimeflow.train.backends.megatron.checkpoint"]
    assert "slimeflow.checkpoint.worker" in edges["slimeflow.checkpoint.convert"]
    assert "slimeflow.checkpoint.safe_pickle" in edges["slimeflow.checkpoint.torch_dist"]  # from pkg import module
    assert "slimeflow.stages.train.trainer" in edges["slimeflow.stages.train.train_actor"]  # inside a method
    assert _stage("slimeflow.stages.train.placement") == "train" and _stage("slimeflow.stages.base") is None
    assert _layer("slimeflow.train.loss") == "library" and _layer("slimeflow.io.storage") == "io"
    assert _layer("slimeflow.flows.pipeline") == "orchestration" and _layer("slimeflow.stages") == "stages"
    # under `if TYPE_CHECKING:` (never run): not an edge
    assert "slimeflow.engine.server" not in edges["slimeflow.engine.control"]


def test_no_stage_imports_another_stages_module():
    crossing = {(_short(module), _short(target)) for module, targets in graph().items() for target in targets
                if _stage(module) and _stage(target) and _stage(module) != _stage(target)}
    assert crossing == set(), "a stage imports another stage's module: move the shared code into a library " \
        "(slimeflow/train/, rollout/, checkpoint/, families/, config/, engine/, preprocess/) or io/"


def test_no_import_circles():
    cycles = {frozenset(_short(m) for m in component) for component in _cycles()}
    assert cycles == set(), "modules import each other (function-level imports count): move what both need into " \
        "a third module, or pass a callable in"


def test_the_layers_import_only_downwards():
    """orchestration -> stages -> io -> libraries: a library or io never imports a stage (stages/base.py included)
    or a flow; a stage never imports a flow. No exceptions."""
    allowed = {"orchestration": {"orchestration", "stages", "io", "library"}, "stages": {"stages", "io", "library"},
               "io": {"io", "library"}, "library": {"io", "library"}}
    upward = {(module, target) for module, targets in graph().items() for target in targets
              if _layer(target) not in allowed[_layer(module)]}
    assert upward == set()


def test_the_libraries_live_where_the_architecture_says():
    """The RL math and the backends are a library (slimeflow/train/), every stage config is in slimeflow/config/,
    the error types in slimeflow/errors.py; no stage folder holds a config module of its own."""
    names = set(modules())
    assert {"slimeflow.train.loss", "slimeflow.train.advantages", "slimeflow.train.packing",
            "slimeflow.train.train_step", "slimeflow.train.backends.torch.backend",
            "slimeflow.train.backends.megatron.backend", "slimeflow.errors"} <= names
    assert {"slimeflow.stages.train.loop", "slimeflow.stages.train.rollout_manager",
            "slimeflow.stages.train.train_actor"} <= names
    assert not [n for n in names if n.startswith(STAGES + ".") and n.endswith(".config")]
    assert not [n for n in names if n.startswith("slimeflow.stages.rl")]
