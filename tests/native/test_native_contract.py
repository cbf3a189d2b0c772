"""The native twins' typed contract: every extension setup.py declares is built (a missing one
fails here instead of quietly skipping the native half of the twin tests), and each built
module matches its stub in ``trillm/_ext/*.pyi`` -- the scheduler's and KV manager's stubs
declare the Python twins' classes, so native and twin must expose the same API."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
from scheduler_twin_helpers import ecr, get_impl, make_scheduler

from trillm.engine import detokenizer as py_detok

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "trillm" / "_ext"


def declared_extensions() -> list[str]:
    """The ``trillm._ext.<name>`` modules setup.py builds: its pybind11 modules, named in
    full, and its Cython list (``modules = [...]``, named ``f"trillm._ext.{name}"``)."""
    text = (ROOT / "setup.py").read_text()
    cython = re.search(r"modules = \[([^\]]*)\]", text)
    assert cython, "setup.py's Cython module list moved: update this test"
    return sorted(
        set(re.findall(r'"trillm\._ext\.(\w+)"', text))
        | set(re.findall(r'"(\w+)"', cython.group(1)))
    )


def stub_names(name: str) -> set[str]:
    """The public names a stub declares (imports re-exported with ``as``, classes, values)."""
    tree = ast.parse((STUBS / f"{name}.pyi").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname for a in node.names if a.asname == a.name)
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


def test_every_declared_extension_is_built_and_has_a_stub():
    names = declared_extensions()
    assert names == [
        "cpu_kernels",
        "detokenizer",
        "kv_cache_manager",
        "request_queues",
        "scheduler",
        "step_outputs",
        "step_plan",
    ]
    for name in names:
        # NOTE: fail, not skip: a CI run without the native half must not look green.
        importlib.import_module(f"trillm._ext.{name}")
        assert (STUBS / f"{name}.pyi").is_file(), name


@pytest.mark.parametrize("name", ["cpu_kernels", "detokenizer", "kv_cache_manager", "scheduler"])
def test_every_stub_name_exists_in_the_built_module(name):
    module = importlib.import_module(f"trillm._ext.{name}")
    declared = stub_names(name)
    assert declared
    assert declared <= set(dir(module)), declared - set(dir(module))


def test_cpu_kernel_parts_have_the_declared_functions():
    module = importlib.import_module("trillm._ext.cpu_kernels")
    tree = ast.parse((STUBS / "cpu_kernels.pyi").read_text())
    protocols = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    parts = {
        n.target.id: n.annotation.id
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    for part, proto in parts.items():
        members = {
            m.target.id if isinstance(m, ast.AnnAssign) else m.name
            for m in protocols[proto].body
            if isinstance(m, ast.FunctionDef | ast.AnnAssign)
        }
        members -= {"__init__"}
        got = set(dir(getattr(module, part)))
        assert members <= got, (part, members - got)
        for fn in members:
            obj = getattr(getattr(module, part), fn)
            if callable(obj) and not inspect.isclass(obj):
                stub = next(
                    m
                    for m in protocols[proto].body
                    if isinstance(m, ast.FunctionDef) and m.name == fn
                )
                params = [a.arg for a in stub.args.args[1:]]
                doc = obj.__doc__.splitlines()[0]
                assert re.findall(r"(\w+): ", doc.split("->")[0]) == params, (part, fn, doc)


def _public(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


@pytest.mark.parametrize("cls", ["Scheduler", "KVCacheManager", "Request"])
def test_native_classes_expose_exactly_the_twins_api(cls):
    py, native = get_impl("python"), get_impl("native")
    if cls == "Scheduler":
        a, b = make_scheduler(py), make_scheduler(native)
    elif cls == "KVCacheManager":
        a, b = (impl.KVCacheManager(64, 4, True) for impl in (py, native))
    else:
        a, b = (impl.Request.from_engine_core_request(ecr("r", [1, 2, 3])) for impl in (py, native))
    assert _public(a) == _public(b), _public(a) ^ _public(b)
    for name in _public(b):
        assert callable(getattr(a, name)) == callable(getattr(b, name)), name


@pytest.mark.parametrize(
    "cls,twin",
    [("Vocab", py_detok.PyVocab), ("IncrementalDetokenizer", py_detok.PyIncrementalDetokenizer)],
)
def test_the_detokenizer_twins_take_the_same_parameters(cls, twin):
    native = getattr(importlib.import_module("trillm._ext.detokenizer"), cls)
    doc = native.__init__.__doc__.splitlines()[0]
    native_params = re.findall(r"(\w+): ", doc.split("->")[0])[1:]  # without self
    assert native_params == list(inspect.signature(twin).parameters)
    stub = next(
        n
        for n in ast.parse((STUBS / "detokenizer.pyi").read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == cls
    )
    init = next(m for m in stub.body if isinstance(m, ast.FunctionDef) and m.name == "__init__")
    assert [a.arg for a in init.args.args[1:]] == native_params
