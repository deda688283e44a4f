"""The layers of the house (issue 44), read from the source: every `import` statement of mmdata
and mmtrain, function-level ones included, parsed with `ast` (nothing is imported).

Definitions the checks use:
- A *module* is a .py file under mmdata/ or mmtrain/ (`pkg/__init__.py` is the module `pkg`).
- An *edge* goes from a module to each project module an import statement names: `import a.b.c`
  names `a.b.c`; `from a.b import c` names `a.b.c` when that is a module, else `a.b`; relative
  imports are resolved against the importing module's package. Implicit parent-package imports are
  not edges. `if TYPE_CHECKING:` imports are edges too (a layer knows nothing above it, even in
  its annotations).
- A module's *package* is its first level below mmdata/ or mmtrain/: the subpackage directory it
  lives in (`mmdata/preprocess/job.py` and `mmdata/energon_loaders/llava_ov/loader.py` are in
  `mmdata.preprocess` and `mmdata.energon_loaders`), or, for a module at the top (`mmdata/cli.py`,
  `mmtrain/registry.py`), the module itself; the top `__init__` is the package `mmdata`/`mmtrain`.
  Those are the rooms of the layer drawing (docs/architecture.md, the review's package view): a
  top-level module such as the CLI or the registry sits on its own floor.
- A *function-level* import is an import statement inside a function or method body.

The checks: no mmdata -> mmtrain edge; no cycle among packages; function-level imports only at
the three named boundaries (`CLI_MODULES`, a subcommand's `run`, `RAY_TASK_BODIES`) or of an optional
heavy dependency (`OPTIONAL_HEAVY`);
fewer than 120 function-level imports in all.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("mmdata", "mmtrain")
FUNCTION_LEVEL_TARGET = 120  # issue 44: fewer than this many function-level imports in the product

#: The three boundaries where a function-level import is allowed.
#: - CLI dispatch: the two top CLIs (any function), and a subcommand's `run`: a subcommand module
#:   (one with top-level `add_arguments` and `run`, the protocol of mmdata/cli.py) is imported for
#:   its `--help`, and its `run` imports the job it starts (tests/test_cli_startup.py holds `--help`
#:   light).
#: - The registry's "module:function" callables: resolved by `importlib.import_module`, so they
#:   need no import statement and no entry here.
#: - Ray task bodies (`RAY_TASK_BODIES`): the functions and actor classes Ray runs in its worker
#:   processes, which import what the task needs there rather than in the driver.
CLI_MODULES = ("mmdata.cli", "mmtrain.cli")
SUBCOMMAND_PROTOCOL = frozenset({"add_arguments", "run"})
#: module -> the top-level functions or classes (every method) that Ray runs, each with its reason
RAY_TASK_BODIES: dict[str, dict[str, str]] = {
    "mmdata.stage_runner": {"_reporting": "wraps every stage function of both Ray jobs; its `run` is the task"},
    "mmdata.vision_tokens.stages": {"TokenizeWorker": "the tokenizing job's Ray actor (loads the VQ on its worker)"},
}

#: Third-party modules a function may import lazily anywhere: optional or heavy dependencies that
#: only some paths need (a module name, matching it and its submodules, with the reason). A dotted
#: name allows that part of a library only (`megatron.core.extensions`, not all of megatron).
OPTIONAL_HEAVY: dict[str, str] = {
    "decord": "video decoding only for video samples; a native library with its own thread pool",
    "av": "video decoding/encoding only for video samples (PyAV, FFmpeg bindings)",
    "transformer_engine": "optional on GPU hosts, absent on CPU (mmtrain/models/te_support.py decides)",
    "megatron.core.extensions": "megatron's Transformer Engine layers: import TE, optional on GPU hosts, absent on CPU",
    "flash_attn": "optional GPU attention kernel (models/attention.py falls back to torch's)",
    "torch.nn.attention.varlen": "torch's variable-length attention, in newer torch builds only",
    "cut_cross_entropy": "optional memory-lean LM-loss kernel (models/lm_loss.py: model.loss_impl)",
    "liger_kernel": "optional fused LM-loss kernel (models/lm_loss.py: model.loss_impl)",
    "tensorboard": "optional metrics writer (metrics.tensorboard); not installed by default",
    "torch.utils.tensorboard": "torch's writer over the optional tensorboard package",
    "ray": "the Ray jobs' runtime, the optional extra `data` (pyproject.toml): imported where a job starts or uses "
    "Ray, so the training side runs without it and no `--help` imports it",
    "transformers": "imports torch (seconds): the length-scan Ray workers count with `tokenizers` alone and load an "
    "HF tokenizer (mmdata/local_tokenizer.py, chat_template.add_media_tokens) only when one is needed",
    "IPython": "only inside a notebook (mmdata/inspect/notebook.py shows a sample there)",
}


def optional_heavy(target: str) -> bool:
    """Whether `target` is (inside) one of `OPTIONAL_HEAVY`'s modules."""
    return any(target == name or target.startswith(name + ".") for name in OPTIONAL_HEAVY)


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` module imports `target` (a module name)."""

    source: str
    target: str
    line: int
    function: str | None  # qualified name of the enclosing function; None at module level

    @property
    def internal(self) -> bool:
        return self.target.split(".")[0] in PACKAGES


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The first level below the top package: `a.b.c.d` -> `a.b`; `a.b` -> `a.b`; `a` -> `a`."""
    return ".".join(module.split(".")[:2])


def project_modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.module, self.is_package, self.modules = module, is_package, modules
        self.scope: list[str] = []
        self.depth = 0  # function nesting
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.stmt) -> None:
        fn = ".".join(self.scope) if self.depth else None
        self.found.append(Import(self.module, target, node.lineno, fn))

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, function: bool) -> None:
        self.scope.append(node.name)
        self.depth += function
        self.generic_visit(node)
        self.depth -= function
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, True)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, True)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, False)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.module if self.is_package else self.module.rpartition(".")[0]
            base_parts = package.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base == "__future__":
            return
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.modules else base, node)


def collect_imports(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> tuple[dict[str, Path], list[Import]]:
    modules = project_modules(root, packages)
    found: list[Import] = []
    for name, path in modules.items():
        collector = _Collector(name, path.name == "__init__.py", modules)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        found += collector.found
    return modules, found


def project_target(imp: Import, modules: dict[str, Path]) -> str | None:
    """The project module an edge lands on (the nearest enclosing module for `from pkg import name`)."""
    target = imp.target
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def package_graph(modules: dict[str, Path], imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        target = project_target(imp, modules) if imp.internal else None
        if target is None:
            continue
        a, b = package_of(imp.source), package_of(target)
        if a != b:
            graph[a].add(b)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's SCCs with more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    nodes = set(graph) | {w for ws in graph.values() for w in ws}
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(nodes) + 100))
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(out)


def top_level_names(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's top-level function and class names (the subcommand protocol looks for two)."""
    return {
        name: {
            n.name
            for n in ast.parse(path.read_text()).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        }
        for name, path in modules.items()
    }


def at_boundary(imp: Import, top_level: dict[str, set[str]]) -> bool:
    """Whether a function-level import sits at one of the named boundaries (`CLI_MODULES`, a
    subcommand's `run`, `RAY_TASK_BODIES`)."""
    outer = (imp.function or "").split(".")[0]
    if imp.source in CLI_MODULES:
        return True
    if outer == "run" and SUBCOMMAND_PROTOCOL <= top_level.get(imp.source, set()):
        return True
    return outer in RAY_TASK_BODIES.get(imp.source, {})


def misplaced_lazy_imports(modules: dict[str, Path], imports: list[Import]) -> list[Import]:
    """Function-level imports outside the boundaries that are not an optional heavy dependency."""
    top_level = top_level_names(modules)
    return [
        imp
        for imp in imports
        if imp.function is not None
        and not at_boundary(imp, top_level)
        and (imp.internal or not optional_heavy(imp.target))
    ]


def figures(modules: dict[str, Path], imports: list[Import]) -> dict:
    """What the checks measure, for a report (`python -m tests.test_layers`)."""
    lazy = [imp for imp in imports if imp.function is not None]
    statements = {(i.source, i.line) for i in lazy}  # `from a import b, c` is one statement, two edges
    return {
        "modules": len(modules),
        "mmdata_to_mmtrain": sorted(
            {
                f"{i.source}:{i.line} -> {i.target}"
                for i in imports
                if i.source.startswith("mmdata") and i.target.split(".")[0] == "mmtrain"
            }
        ),
        "package_cycles": strongly_connected(package_graph(modules, imports)),
        "function_level": len(statements),
        "function_level_internal": len({(i.source, i.line) for i in lazy if i.internal}),
        "function_level_modules": len({i.source for i in lazy}),
        "function_level_by_package": dict(Counter(package_of(s) for s, _ in statements).most_common()),
        "misplaced": len({(i.source, i.line) for i in misplaced_lazy_imports(modules, imports)}),
    }


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Import]]:
    return collect_imports()


# ----------------------------------------------------------------------------- the reader itself


def test_reader_resolves_relative_function_level_and_dotted_imports(tmp_path):
    pkg = tmp_path / "mmdata"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import sub\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "a.py").write_text(
        "import os\nfrom .sub import leaf\nfrom .sub.leaf import X\n"
        "class C:\n    def m(self):\n        import mmdata.sub.leaf\n        from ..mmdata import a\n"
        "def f():\n    def g():\n        from mmtrain.x import y\n    return g\n"
    )
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom ..sub import leaf as L\n")
    modules, imports = collect_imports(tmp_path, ("mmdata",))
    assert set(modules) == {"mmdata", "mmdata.a", "mmdata.sub", "mmdata.sub.leaf", "mmdata.sub.b"}
    got = {(i.source, i.target, i.function) for i in imports}
    assert got == {
        ("mmdata", "mmdata.sub", None),
        ("mmdata.a", "os", None),
        ("mmdata.a", "mmdata.sub.leaf", None),
        ("mmdata.a", "mmdata.sub.leaf", "C.m"),
        ("mmdata.a", "mmtrain.x", "f.g"),
        ("mmdata.a", "mmdata.sub.leaf", None),
        ("mmdata.sub.b", "mmdata.a", None),
        ("mmdata.sub.b", "mmdata.sub.leaf", None),
    } | {("mmdata.a", "mmdata.a", "C.m")}
    assert package_of("mmdata.sub") == package_of("mmdata.sub.b") == package_of("mmdata.sub.x.y") == "mmdata.sub"
    assert package_of("mmdata.a") == "mmdata.a" and package_of("mmdata") == "mmdata"
    # mmdata.a -> mmdata.sub (leaf) and mmdata.sub.b -> mmdata.a: a cycle of two packages
    assert strongly_connected(package_graph(modules, imports)) == [["mmdata.a", "mmdata.sub"]]
    lazy = misplaced_lazy_imports(modules, imports)
    assert {(i.target, i.function) for i in lazy} == {
        ("mmdata.sub.leaf", "C.m"),
        ("mmdata.a", "C.m"),
        ("mmtrain.x", "f.g"),
    }


def test_the_whole_product_is_read(graph):
    modules, imports = graph
    assert {"mmdata.cli", "mmtrain.cli", "mmdata.stage_runner", "mmtrain.runtime.trainer"} <= set(modules)
    assert len(modules) > 150 and len(imports) > 1000
    top_level = top_level_names(modules)
    for module in CLI_MODULES:
        assert module in modules, f"CLI_MODULES names {module}, which is gone"
    for module, names in RAY_TASK_BODIES.items():
        assert module in modules and set(names) <= top_level[module], f"RAY_TASK_BODIES: {module} {set(names)} gone"


# ----------------------------------------------------------------------------- the layers


def test_mmdata_imports_nothing_from_mmtrain(graph):
    modules, imports = graph
    edges = figures(modules, imports)["mmdata_to_mmtrain"]
    assert not edges, "mmdata imports mmtrain:\n  " + "\n  ".join(edges)


def test_no_cycle_between_packages(graph):
    cycles = strongly_connected(package_graph(*graph))
    assert not cycles, "packages that import each other (directly or round a loop):\n  " + "\n  ".join(
        " <-> ".join(c) for c in cycles
    )


def test_function_level_imports_only_at_the_named_boundaries(graph):
    bad = misplaced_lazy_imports(*graph)
    assert not bad, (
        f"{len(bad)} function-level imports outside CLI dispatch, Ray task bodies and the optional "
        "heavy dependencies (move them to the top of the module; break the cycle that forced one):\n  "
        + "\n  ".join(f"{i.source}:{i.line} ({i.function}) imports {i.target}" for i in bad[:60])
    )


def test_mmtrain_holds_its_layers(graph):
    """mmtrain's share of the two checks above, held already: no cycle among its packages, and its
    function-level imports only at the named boundaries (mmdata's share lands with its renovation)."""
    modules, imports = graph
    cycles = [c for c in strongly_connected(package_graph(modules, imports)) if any(p.startswith("mmtrain") for p in c)]
    bad = [i for i in misplaced_lazy_imports(modules, imports) if i.source.startswith("mmtrain")]
    assert not cycles, "mmtrain packages that import each other:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)
    assert not bad, "\n  ".join(f"{i.source}:{i.line} ({i.function}) imports {i.target}" for i in bad)


def test_fewer_than_120_function_level_imports(graph):
    numbers = figures(*graph)
    print(
        f"function-level imports: {numbers['function_level']} ({numbers['function_level_internal']} of the "
        f"project's own modules); by package: {numbers['function_level_by_package']}"
    )
    assert numbers["function_level"] < FUNCTION_LEVEL_TARGET, numbers["function_level_by_package"]


if __name__ == "__main__":  # the figures for a report
    import json

    print(json.dumps(figures(*collect_imports()), indent=1))
