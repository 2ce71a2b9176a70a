"""The package's layers (docs/architecture.md): every import goes down or stays within its layer, and no
module imports itself back through others, counting the imports made inside functions too."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import chunkmem

PACKAGE = Path(chunkmem.__file__).resolve().parent
LAYERS = [  # bottom first: a module imports only from its own layer and the layers below it
    ("foundations", ["chunkmem.config", "chunkmem.errors", "chunkmem.files", "chunkmem.version"]),
    ("memory", ["chunkmem.memory"]),
    ("chunks", ["chunkmem.chunks"]),
    ("zero", ["chunkmem.zero"]),
    ("runtime", ["chunkmem.runtime"]),
    ("public face", ["chunkmem.wrapper", "chunkmem.checkpoint", "chunkmem.manager"]),
    ("applications", ["chunkmem.pipeline", "chunkmem.finetune", "chunkmem.trace", "chunkmem.commands",
                      "chunkmem.trainer", "chunkmem.dpo", "chunkmem.selftest", "chunkmem.cli", "chunkmem"]),
]


EXTENSIONS = {"chunkmem._C"}  # compiled modules setup.py may build; no Python file, no imports of their own


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if "boot" in parts:  # sitecustomize: imported by the interpreter, not by chunkmem
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The chunkmem modules a file imports, anywhere in it but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("chunkmem"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name not in EXTENSIONS:
                    out.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("chunkmem"))
    return {m for m in out if m in known}


def layer_of(module: str) -> int:
    best = max(((i, prefix) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), key=lambda x: len(x[1]), default=None)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS (and to docs/architecture.md)"
    return best[0]


def test_every_import_goes_down_or_stays_in_its_layer():
    known = modules()
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {i} ({LAYERS[layer_of(i)][0]})"
              for m, path in known.items() for i in imports(path, known) if layer_of(i) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_no_module_imports_itself_back():
    known = modules()
    graph = {m: imports(path, known) - {m} for m, path in known.items()}
    loops = []

    def visit(module: str, trail: list[str]) -> None:
        for target in graph[module]:
            if target in trail:
                loops.append(trail[trail.index(target):] + [target])
            elif target not in done:
                visit(target, trail + [target])
        done.add(module)

    done: set[str] = set()
    for module in graph:
        if module not in done:
            visit(module, [module])
    assert not loops, "\n".join(" -> ".join(loop) for loop in loops)


def test_the_layers_are_folders():
    # The tree shows the architecture: every module under chunkmem/ sits in a layer's folder, or is one of
    # the few top-level modules the layers name.
    named = {p for _, prefixes in LAYERS for p in prefixes}
    for module in modules():
        parts = module.split(".")
        assert len(parts) == 1 or ".".join(parts[:2]) in named, f"{module}: put it in a layer's folder"


def test_importing_chunkmem_leaves_the_heavy_torch_subsystems_to_their_users():
    # torch.distributed.pipelining brings in dynamo and sympy, about a second: only a pipeline needs it.
    heavy = ["torch.distributed.pipelining", "torch._dynamo", "sympy", "transformers"]
    code = f"import sys, chunkmem; print([m for m in {heavy!r} if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"`import chunkmem` imported {loaded.strip()}"


def test_chunk_families_are_declared_and_named_in_one_module():
    # chunks/family.py's Note: families are declared there once, and a chunk's name is made there, so nothing
    # else builds a Family or takes a chunk's name apart to learn its family.
    declaring = PACKAGE / "chunks" / "family.py"
    for module, path in modules().items():
        if path == declaring:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
                called = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                assert called != "Family", f"{module}:{node.lineno} builds a Family: declare it in {declaring.name}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not re.search(r"frozen_($|param|\{)", node.value), \
                    f"{module}:{node.lineno} spells a chunk name's prefix"
