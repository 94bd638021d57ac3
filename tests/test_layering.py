"""The package's layering, read from the source with `ast`: every import statement of every
module of nanovllm, those inside functions and `if TYPE_CHECKING:` blocks included.

The intended order, top to bottom (a package may import those below it, never one above):

    llm.py -> data_parallel -> engine -> executor -> runner -> lora -> config -> models -> layers
                      serve -> engine                                              -> kernels

config sits above the model side because it checks a checkpoint against the model registry and
the kernels; lora (adapters and the runner's slot manager) sits just below the runner, which
owns its slots. sequence, sampling_params, utils and lora.request (LoRARequest, which the public
API and the server name) are below them all, usable by every package."""
import ast
import os
import subprocess
import sys
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanovllm"

# What each layer may import, besides itself: the order above, written out. "nanovllm" is the
# package's own __init__ (the public names); a layer is a subpackage or a top-level module.
BASE = {"sequence", "sampling_params", "utils", "lora.request"}
MODEL_SIDE_BELOW_CONFIG = {"models", "layers", "kernels"}
ALLOWED = {
    "nanovllm": {"llm", "sampling_params"},
    "llm": {"data_parallel", "engine", "executor", "runner", "lora", "config"}
    | MODEL_SIDE_BELOW_CONFIG | BASE,
    "data_parallel": {"engine", "executor", "runner", "lora", "config"}
    | MODEL_SIDE_BELOW_CONFIG | BASE,
    "serve": {"engine", "executor", "runner", "lora", "config"} | MODEL_SIDE_BELOW_CONFIG | BASE,
    "engine": {"executor", "runner", "lora", "config"} | MODEL_SIDE_BELOW_CONFIG | BASE,
    "executor": {"runner", "lora", "config"} | MODEL_SIDE_BELOW_CONFIG | BASE,
    "runner": {"lora", "config"} | MODEL_SIDE_BELOW_CONFIG | BASE,
    "lora": {"config"} | MODEL_SIDE_BELOW_CONFIG | BASE,
    "lora.request": {"utils"},
    "config": MODEL_SIDE_BELOW_CONFIG | BASE,
    "models": {"layers"} | BASE,  # never kernels: layers/backends.py chooses them
    "layers": {"kernels"} | BASE,
    "kernels": BASE,
    "sequence": {"sampling_params", "utils"},
    "sampling_params": {"utils"},
    "utils": set(),
}
# The model side: no serving stack, no Ray (`pip install nanovllm` runs without either).
MODEL_SIDE = ["engine", "runner", "executor", "lora", "models", "layers", "kernels"]
SERVING_AND_RAY = ["nanovllm.serve", "ray", "fastapi", "uvicorn", "starlette",
                   "prometheus_client"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    """nanovllm.engine.llm_engine -> engine; nanovllm.llm -> llm; nanovllm -> nanovllm;
    nanovllm.lora.request -> lora.request (a layer of its own, below the rest of lora)."""
    if module == "nanovllm.lora.request":
        return "lora.request"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@cache
def imports(module: str) -> tuple[tuple[int, str, bool], ...]:
    """(line, imported module, deferred) for every import in `module`'s source, once per line
    and module; deferred: inside a function (it runs when called, not at import). `from a
    import b` yields a.b when that is a module of nanovllm, else a; relative imports are
    resolved."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = {}

    def visit(node: ast.AST, deferred: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault((node.lineno, alias.name), deferred)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                name = f"{source}.{alias.name}"
                found.setdefault((node.lineno, name if name in MODULES else source), deferred)
        deferred = deferred or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef
                                          | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, deferred)

    visit(ast.parse(path.read_text(), str(path)), False)
    return tuple((line, name, deferred) for (line, name), deferred in found.items())


def internal(name: str) -> str | None:
    """The module of nanovllm that an import of `name` loads (None: outside the package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_every_module_parses_and_has_a_layer():
    assert len(MODULES) > 40
    unknown = {layer(m) for m in MODULES} - set(ALLOWED)
    assert not unknown, f"add these to ALLOWED in tests/test_layering.py: {sorted(unknown)}"


def test_the_parser_sees_top_level_and_deferred_imports():
    """So that the checks below cannot pass by seeing nothing."""
    found = {(name, deferred) for _, name, deferred in imports("nanovllm.serve.engine_process")}
    assert ("nanovllm.serve.engine_loop", False) in found
    assert ("nanovllm.engine.llm_engine", True) in found  # inside _engine_main
    assert ("multiprocessing", False) in found


@pytest.mark.parametrize("side", MODEL_SIDE)
def test_the_model_side_never_imports_serving_or_ray(side):
    bad = [f"{where(m, line)}: {name}" for m in MODULES if layer(m) == side
           for line, name, _ in imports(m)
           if any(name == f or name.startswith(f + ".") for f in SERVING_AND_RAY)]
    assert not bad, (f"nanovllm/{side} imports the serving stack or Ray:\n  "
                     + "\n  ".join(bad))


def test_models_do_not_import_kernels():
    """Models are built from layers; a kernel is reached through the layer that owns it."""
    bad = [f"{where(m, line)}: {name}" for m in MODULES if layer(m) == "models"
           for line, name, _ in imports(m) if name.startswith("nanovllm.kernels")]
    assert not bad, ("nanovllm/models imports nanovllm.kernels (call the kernels through "
                     "nanovllm/layers):\n  " + "\n  ".join(bad))


def test_lora_package_imports_only_the_request():
    """`from nanovllm.lora import LoRARequest` loads the request, not adapters or slots."""
    names = {name for _, name, _ in imports("nanovllm.lora") + imports("nanovllm.lora.request")}
    assert {internal(n) for n in names} - {None} <= {"nanovllm.lora.request",
                                                     "nanovllm.utils.field_checks"}
    assert not names & {"torch", "safetensors", "transformers"}


def upward_imports() -> list[str]:
    found = []
    for m in MODULES:
        for line, name, _ in imports(m):
            target = internal(name)
            if target is None or layer(target) == layer(m):
                continue
            if layer(target) not in ALLOWED[layer(m)]:
                found.append(f"{where(m, line)}: {layer(m)} -> {layer(target)} ({name})")
    return found


def test_no_package_imports_one_above_it():
    bad = upward_imports()
    print("\n".join(["layering violations:"] + bad) if bad else "no layering violations")
    assert not bad, ("imports against the layer order (see ALLOWED in tests/test_layering.py):"
                     "\n  " + "\n  ".join(bad))


def test_no_import_cycles_between_modules():
    """A DFS over the module graph; an import inside a function counts too (it is a cycle that
    only works because the import is deferred)."""
    graph = defaultdict(dict)  # module -> {imported module: where}
    for m in MODULES:
        for line, name, deferred in imports(m):
            target = internal(name)
            if target is not None and target != m:
                graph[m].setdefault(target, where(m, line) + (" (in a function)" if deferred
                                                              else ""))
    cycles, state = [], {}  # state: 1 on the DFS stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                ring = stack[stack.index(t):] + [t]
                cycles.append(" -> ".join(ring) + "\n      " + "; ".join(
                    graph[a][b] for a, b in zip(ring, ring[1:])))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_public_imports_work():
    """What users write, in a fresh interpreter."""
    code = ("from nanovllm.lora import LoRARequest\n"
            "from nanovllm import LLM, SamplingParams\n"
            "import nanovllm.sampling_params\n"
            "assert nanovllm.sampling_params.SamplingParams is SamplingParams\n"
            "assert LLM.__module__ == 'nanovllm.llm'\n")
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_server_help_runs():
    proc = run("-m", "nanovllm.serve", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage: python -m nanovllm.serve" in proc.stdout
