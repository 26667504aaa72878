"""`python/kvduplex/_core.pyi` states what the built extension (`rust/src/python/`) does: the same
classes, exception bases, methods and properties, and for every method the same parameters, in
the same kinds (positional, keyword-only) and with the same defaults. The extension's signatures
are read from its `__text_signature__`s (pyo3 writes them from each `#[pyo3(signature = ...)]`).
"""

from __future__ import annotations

import ast
import inspect
import time
from pathlib import Path

import pytest

from kvduplex import _core

STUB = Path(_core.__file__).with_name("_core.pyi")
# Dunder methods that are part of the typed surface (the rest, __repr__ and so on, are not).
TYPED_DUNDERS = ("__init__", "__enter__", "__exit__")


def _stub_classes() -> dict[str, ast.ClassDef]:
    tree = ast.parse(STUB.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _is_property(function: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in function.decorator_list)


def _stub_members(node: ast.ClassDef) -> tuple[dict[str, ast.FunctionDef], set[str]]:
    """The class's methods and its properties."""
    methods: dict[str, ast.FunctionDef] = {}
    properties: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            if _is_property(item):
                properties.add(item.name)
            else:
                methods[item.name] = item
    return methods, properties


def _stub_parameters(function: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter after `self`; default is `inspect._empty` when
    there is none."""
    args = function.args
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    out = [(a.arg, "positional", d) for a, d in zip(positional, defaults, strict=True)]
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        out.append((arg.arg, "keyword", value))
    return out[1:]  # self


def _runtime_parameters(signature: inspect.Signature) -> list[tuple[str, str, object]]:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
    }
    out = []
    for parameter in signature.parameters.values():
        if parameter.name in ("self", "$self"):
            continue
        out.append((parameter.name, kinds[parameter.kind], parameter.default))
    return out


def _runtime_members(cls: type) -> tuple[set[str], set[str]]:
    """The class's own methods and properties (getset descriptors), as the extension has them."""
    methods, properties = set(), set()
    for name, value in vars(cls).items():
        if name.startswith("__") and name not in TYPED_DUNDERS:
            continue
        if inspect.isgetsetdescriptor(value) or isinstance(value, property):
            properties.add(name)
        elif callable(value):
            methods.add(name)
    if getattr(cls, "__text_signature__", None):
        methods.add("__init__")  # pyo3's #[new]: the class carries the constructor's signature
    return methods, properties


def _compare(where: str, stub: list, runtime: list) -> None:
    assert [p[:2] for p in stub] == [p[:2] for p in runtime], f"{where}: parameters differ"
    for (name, _, stub_default), (_, _, runtime_default) in zip(stub, runtime, strict=True):
        if runtime_default is Ellipsis:
            # pyo3 writes `...` for a default that is an expression (`"127.0.0.1".to_string()`,
            # `Vec::new()`): the stub must have one; its value is checked by behaviour below.
            assert stub_default is not inspect.Parameter.empty, f"{where}({name}): no default"
        else:
            assert stub_default == runtime_default, f"{where}({name}): default differs"


def test_the_stub_and_the_extension_have_the_same_classes():
    stub = _stub_classes()
    runtime = {
        name: value
        for name, value in vars(_core).items()
        if isinstance(value, type) and not name.startswith("_")
    }
    assert sorted(stub) == sorted(runtime)
    for name, node in stub.items():
        # A class's own name is the one it is exported under (tracebacks print it).
        assert runtime[name].__name__ == name
        stub_bases = [base.id for base in node.bases if isinstance(base, ast.Name)]
        runtime_bases = [base.__name__ for base in runtime[name].__bases__ if base is not object]
        assert stub_bases == runtime_bases, name


@pytest.mark.parametrize("class_name", ["Engine", "Transfer", "Lookup"])
def test_the_stub_states_every_method_and_its_signature(class_name):
    cls = getattr(_core, class_name)
    stub_methods, stub_properties = _stub_members(_stub_classes()[class_name])
    runtime_methods, runtime_properties = _runtime_members(cls)
    assert sorted(stub_properties) == sorted(runtime_properties), f"{class_name} properties"
    assert sorted(stub_methods) == sorted(runtime_methods), f"{class_name} methods"
    for name, function in stub_methods.items():
        if name == "__init__":
            runtime = inspect.signature(cls)
        else:
            runtime = inspect.signature(getattr(cls, name))
        _compare(f"{class_name}.{name}", _stub_parameters(function), _runtime_parameters(runtime))


def test_defaults_the_extension_cannot_spell_are_the_stubs():
    """The `...` defaults of the text signatures, checked by what the engine does with them."""
    stub_methods, _ = _stub_members(_stub_classes()["Engine"])
    init = {name: default for name, _, default in _stub_parameters(stub_methods["__init__"])}
    with _core.Engine("stub-check", {"model": "none"}) as engine:
        assert engine.side_channel_host == init["host"]
        hold = {name: default for name, _, default in _stub_parameters(stub_methods["hold"])}
        assert hold["offer"] == b""
        engine.hold("r", 1, time.time() + 30, fingerprints=["0" * 16], turn=True)  # offer left out: b""
