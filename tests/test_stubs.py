"""ucxx/_ucxx.pyi describes the C module: every name it declares exists,
every public C name is declared, and C methods carry text signatures."""

import ast
import inspect
import pathlib

import pytest

import ucxx
from ucxx import _ucxx

STUB = pathlib.Path(ucxx.__file__).with_name("_ucxx.pyi")


def _stub_names():
    tree = ast.parse(STUB.read_text())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.add(node.name)
            names = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    names.add(item.target.id)
            members[node.name] = names
        elif isinstance(node, ast.FunctionDef):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            top.add(node.target.id)
    return top, members


TOP, MEMBERS = _stub_names()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(TOP))
def test_declared_name_exists(name):
    assert hasattr(_ucxx, name)
    for member in MEMBERS.get(name, ()):
        assert hasattr(getattr(_ucxx, name), member), f"{name}.{member}"


@pytest.mark.timeout(30)
def test_every_public_name_is_declared():
    public = {n for n in dir(_ucxx) if not n.startswith("_")}
    assert public - TOP == set()
    for cls in (_ucxx.Context, _ucxx.Worker, _ucxx.Endpoint, _ucxx.Listener,
                _ucxx.Request):
        names = {n for n in vars(cls) if not n.startswith("_")}
        assert names - MEMBERS[cls.__name__] == set(), cls.__name__


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls", ["Context", "Worker", "Endpoint", "Listener",
                                 "Request", "ProgressCoroutine"])
def test_methods_have_signatures(cls):
    for name, attr in vars(getattr(_ucxx, cls)).items():
        if name.startswith("__") or not callable(attr):
            continue
        assert attr.__doc__, f"{cls}.{name} has no docstring"
        if name in ("send", "throw", "close") and cls in ("Request", "ProgressCoroutine"):
            continue
        inspect.signature(attr)  # raises ValueError without a text signature
