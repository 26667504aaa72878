"""Import circles inside a Python package (`make check`): fails, naming one circle per group of
modules that import each other, when any module reaches itself through imports of the package's
own modules.

Counted: every `import` and `from ... import` of the package's modules, absolute or relative, at
module level and inside functions and classes alike (a deferred import is still a dependency),
and those under `if TYPE_CHECKING:` too (a circle of types is still a circle between the
modules; `--runtime-only` leaves those out). `from pkg import name` depends on `pkg.name` when
that is a module, else on `pkg` itself. Not counted: the implicit import of a module's parent
packages, and modules that are not Python source files (the compiled extension).

    python .ci/import_cycles.py [--runtime-only] [PACKAGE_DIR ...]   (default: python/kvduplex)
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from pathlib import Path


def module_names(package_dir: Path) -> dict[str, Path]:
    """Every module of the package under `package_dir`, by dotted name."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_checking: bool = False):
    """(node, under TYPE_CHECKING) for every import statement in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), type_checking)
        else:
            yield from _imports(node, type_checking)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or the longest of its prefixes that is a module of the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def dependencies(
    module: str, path: Path, modules: dict[str, Path], runtime_only: bool
) -> dict[str, int]:
    """The package's modules `module` imports, each with the line of its first import."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module and target not in found:
            found[target] = line

    for node, type_checking in _imports(tree):
        if type_checking and runtime_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known(alias.name, modules), node.lineno)
            continue
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            add(submodule if submodule in modules else _known(source, modules), node.lineno)
    return found


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's groups of mutually reachable modules, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(graph[succ])))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(sorted(group))
    return [g for g in groups if len(g) > 1]


def shortest_circle(graph: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """A shortest circle through the group's first module, staying inside the group."""
    start = group[0]
    members = set(group)
    parent: dict[str, str] = {}
    queue = collections.deque([start])
    while queue:
        node = queue.popleft()
        for succ in graph[node]:
            if succ not in members:
                continue
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if succ not in parent:
                parent[succ] = node
                queue.append(succ)
    raise AssertionError("a strongly connected group has a circle")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", type=Path, default=[Path("python/kvduplex")])
    parser.add_argument(
        "--runtime-only", action="store_true", help="leave out imports under TYPE_CHECKING"
    )
    args = parser.parse_args()
    status = 0
    for package_dir in args.packages:
        modules = module_names(package_dir)
        graph = {
            name: dependencies(name, path, modules, args.runtime_only)
            for name, path in modules.items()
        }
        groups = strongly_connected(graph)
        for group in groups:
            circle = shortest_circle(graph, group)
            print(f"import circle among {len(group)} modules: {', '.join(group)}")
            for source, target in zip(circle, circle[1:]):
                print(f"  {modules[source]}:{graph[source][target]}: {source} imports {target}")
        edges = sum(len(d) for d in graph.values())
        print(
            f"{package_dir}: {len(modules)} modules, {edges} imports between them, "
            f"{len(groups)} import circle{'' if len(groups) == 1 else 's'}"
        )
        status = status or (1 if groups else 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
