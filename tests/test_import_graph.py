"""The package's import graph, read from the `ast` of every module (function-level imports counted): no module of
one stage imports another stage's module (shared code is a library beside the stages: slimeflow/checkpoint/,
families/, config/, engine/, rollout/, preprocess/, cluster.py, offload.py, io/), and no two modules import each
other, directly or round a circle. Imports under `if TYPE_CHECKING:` never run and are not counted.
"""

from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = "slimeflow.stages"

# No exceptions are listed: evaluate and train share the rollout and engine libraries (slimeflow/rollout/, engine/),
# train's inline preprocessing runs the preprocess library (slimeflow/preprocess/), and the circles function-level
# imports closed were untangled by moving the shared piece down (backend/rng.py, remote.call), a loader to the
# adapter it calls (slime_plugins.load_group_filter), and slime's whole rollout function above the rollout
# (slime_rollout_functions.py).


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
    """The stage a module belongs to (`rl` for slimeflow.stages.rl.backend.checkpoint); None outside the stages."""
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


def test_the_graph_sees_the_imports_it_must():
    """The reader itself: a module-level, a function-level, a relative and a `from package import module` import."""
    edges = graph()
    assert "slimeflow.checkpoint.torch_dist" in edges["slimeflow.stages.rl.backend.megatron_checkpoint"]
    assert "slimeflow.checkpoint.worker" in edges["slimeflow.checkpoint.convert"]
    assert "slimeflow.checkpoint.safe_pickle" in edges["slimeflow.checkpoint.torch_dist"]  # from pkg import module
    assert "slimeflow.stages.rl.train_step" in edges["slimeflow.stages.rl.actors"]  # inside a method
    assert _stage("slimeflow.stages.rl.backend.checkpoint") == "rl" and _stage("slimeflow.stages.base") is None
    # under `if TYPE_CHECKING:` (never run): not an edge
    assert "slimeflow.engine.server" not in edges["slimeflow.engine.control"]


def test_no_stage_imports_another_stages_module():
    crossing = {(_short(module), _short(target)) for module, targets in graph().items() for target in targets
                if _stage(module) and _stage(target) and _stage(module) != _stage(target)}
    assert crossing == set(), "a stage imports another stage's module: move the shared code into a library beside " \
        "the stages (slimeflow/checkpoint/, families/, config/, engine/, rollout/, preprocess/)"


def test_no_import_circles():
    cycles = {frozenset(_short(m) for m in component) for component in _cycles()}
    assert cycles == set(), "modules import each other (function-level imports count): move what both need into " \
        "a third module, or pass a callable in"


def test_the_checkpoint_library_and_the_shared_config_import_no_stage():
    """The libraries the stages share import no stage's module, only the stages' common base (stages/base.py)."""
    libraries = ("slimeflow.checkpoint", "slimeflow.families", "slimeflow.cluster", "slimeflow.config.megatron",
                 "slimeflow.config.model", "slimeflow.config.model_args", "slimeflow.config.train", "slimeflow.engine",
                 "slimeflow.rollout", "slimeflow.preprocess", "slimeflow.offload")
    offending = {(module, target) for module, targets in graph().items() if module.startswith(libraries)
                 for target in targets if _stage(target)}
    assert offending == set()
