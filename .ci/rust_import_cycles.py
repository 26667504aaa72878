"""Fail when the Rust crate's modules import each other in a circle (`make check`).

A module is a file under rust/src (lib.rs is `crate`, a/mod.rs and a.rs are `a`, a/b.rs is
`a::b`). Module A depends on module B when A's product code (test modules left out) names
an item of B: a `use` or a path through `crate::`, `super::`, `self::`, a child module or a
name a `use` brought in, and the unqualified names that a glob (`use m::*`) brings in. A
name that a module only imported (`use`, `pub use`) is followed to the module that defines
it, so a re-export does not hide a dependency. A child's use of its ancestors is not a
dependency: a parent composes its children, and they share its private items by Rust's
design. Prints every strongly connected group of modules and exits 1 when there is one.

    python .ci/rust_import_cycles.py [rust/src]
"""

import re
import sys
from pathlib import Path

COMMENT_OR_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'|//[^\n]*|/\*.*?\*/', re.S)
TEST_MODULE = re.compile(r"#\[cfg\(test\)\]\s*mod\s+(\w+)\s*([;{])")
USE = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);")
PATH = re.compile(r"\b\w+(?:::\w+)+")
WORD = re.compile(r"\b[A-Za-z_]\w*\b")


def module_of(src: Path, file: Path) -> tuple:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("lib", "mod"):
        parts.pop()
    return ("crate", *parts)


def product_code(text: str) -> tuple:
    """The code without comments, literals and test modules; the names of test modules."""
    code = COMMENT_OR_LITERAL.sub(lambda m: '""' if m.group(0)[0] in "\"'" else " ", text)
    tests = {m.group(1) for m in TEST_MODULE.finditer(code)}
    inline = next((m for m in TEST_MODULE.finditer(code) if m.group(2) == "{"), None)
    return (code[: inline.start()] if inline else code), tests


def expand(tree: str) -> list:
    """`a::{b, c::{self, d}}` -> ['a::b', 'a::c', 'a::c::d']; `x as y` keeps the path."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))
    if "{" not in tree:
        return [tree]
    head, inner = tree.split("{", 1)
    inner, parts, depth, start = inner[:-1], [], 0, 0
    for i, ch in enumerate(inner + ","):
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            if inner[start:i]:
                parts.append(inner[start:i])
            start = i + 1
    out = []
    for part in parts:
        for path in expand(part):
            out.append(head.rstrip(":") if path == "self" else head + path)
    return out


def main(src: Path) -> int:
    files = {module_of(src, f): f for f in sorted(src.rglob("*.rs"))}
    codes, tests = {}, set()
    for module, file in files.items():
        codes[module], names = product_code(file.read_text())
        tests |= {(*module, name) for name in names}
    modules = {
        m: c for m, c in codes.items() if not any(m[: i + 1] in tests for i in range(len(m)))
    }
    uses = {}  # module -> {name: absolute path}, and its glob sources
    globs = {}
    for module, code in modules.items():
        uses[module], globs[module] = {}, []
        for statement in USE.finditer(code):
            for path in expand(statement.group(1)):
                segments = path.split("::")
                if segments[-1] == "*":
                    globs[module].append(segments[:-1])
                else:
                    uses[module][segments[-1]] = segments

    def absolute(module: tuple, segments: list) -> tuple:
        first, rest = segments[0], segments[1:]
        if first == "crate":
            return ("crate", *rest)
        if first in ("super", "self"):
            base = module
            while segments and segments[0] in ("super", "self"):
                base = base[:-1] if segments[0] == "super" else base
                segments = segments[1:]
            return (*base, *segments)
        if (*module, first) in modules:
            return (*module, *segments)
        if first in uses.get(module, {}) and uses[module][first] != segments:
            return (*absolute(module, uses[module][first]), *rest)
        return ()  # std, an external crate or a local item

    def owner(path: tuple, hops: int = 0) -> tuple:
        """The module that defines the item `path` names, following imports."""
        for cut in range(len(path), 0, -1):
            if path[:cut] in modules:
                module, rest = path[:cut], path[cut:]
                if rest and rest[0] in uses[module] and hops < 16:
                    return owner(absolute(module, uses[module][rest[0]]), hops + 1) or module
                return module
        return ()

    graph = {m: set() for m in modules}
    for module, code in modules.items():
        paths = [p.split("::") for s in USE.finditer(code) for p in expand(s.group(1))]
        paths += [p.group(0).split("::") for p in PATH.finditer(USE.sub(" ", code))]
        words = set(WORD.findall(USE.sub(" ", code)))
        for source in globs[module]:
            base = absolute(module, source)
            paths += [[*base, w] for w in words if base in modules and w in uses[base]]
        for segments in paths:
            if segments[-1] == "*":
                continue
            target = owner(absolute(module, segments))
            if target and target != module and target != module[: len(target)]:
                graph[module].add(target)

    groups = strongly_connected(graph)
    for group in groups:
        print("import circle: " + ", ".join("::".join(m) for m in sorted(group)))
        for m in sorted(group):
            inside = sorted("::".join(t) for t in graph[m] if t in group)
            print(f"    {'::'.join(m)} -> {', '.join(inside)}")
    return 1 if groups else 0


def strongly_connected(graph: dict) -> list:
    """Tarjan's groups of more than one module."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "rust/src")))
