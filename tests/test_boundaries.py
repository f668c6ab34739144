"""The two worlds of the tree: the Prefect process (flows/, tasks/ and the JAX-free packages of
grpo_core) never imports JAX, and grpo_core never imports Prefect. Each import runs in a fresh
interpreter, since this test process has long imported both."""

import ast
import functools
import io
import json
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX_FREE = [
    "grpo_core.config",
    "grpo_core.data",
    "grpo_core.rewards",
    "grpo_core.store",
    "grpo_core.launch",
    "grpo_core.errors",
]
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")


def _modules_of(package: str) -> list[str]:
    base = ROOT / package.replace(".", "/")
    if not base.is_dir():
        return [package]
    return [
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in sorted(base.rglob("*.py"))
    ]


def _loaded_after(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("packages", [JAX_FREE, ["tasks", "flows"]], ids=["jax-free-packages", "prefect-side"])
def test_the_prefect_side_never_imports_jax(packages):
    modules = [m for p in packages for m in _modules_of(p)]
    loaded = _loaded_after(modules)
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"importing {packages} loaded {heavy[:5]}"


def test_grpo_check_imports_no_prefect(tmp_path):
    """`grpo check` and the other commands that run no flow start without Prefect's ~2 s of
    imports: the CLI and the readiness report it prints import none of it (before: the report
    lived beside the Prefect tasks, and a cached check took 5.7 s instead of 3.6)."""
    code = (
        "import json, sys\n"
        "from flows.cli import main\n"
        f"rc = main(['check', '--json', '--set', 'storage.root={tmp_path}'])\n"
        "print(json.dumps([rc, sorted(m for m in sys.modules if m.split('.')[0] == 'prefect')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rc, prefect = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 0 and not prefect, (rc, prefect[:5])


def test_grpo_core_never_names_prefect():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "grpo_core").rglob("*.py")
        if any(line.lstrip().startswith(("import prefect", "from prefect")) for line in p.read_text().splitlines())
    ]
    assert not offenders, offenders
    loaded = _loaded_after(_modules_of("grpo_core.stages") + _modules_of("grpo_core.rl"))
    assert not {m for m in loaded if m.split(".")[0] == "prefect"}


# -- layers inside grpo_core: every import, at module level or inside a function ----------------


def _imports_of(path: pathlib.Path) -> set[str]:
    """The grpo_core modules `path` imports anywhere in it (a function's body included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("grpo_core."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_core"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from grpo_core.nn import lora`
    return found


@functools.lru_cache(maxsize=1)  # one parse of the tree for every layer test
def _package_edges() -> dict[str, set[str]]:
    """grpo_core's sub-package -> the sub-packages it imports from (itself left out)."""
    edges: dict[str, set[str]] = {}
    for path in (ROOT / "grpo_core").rglob("*.py"):
        parts = path.relative_to(ROOT / "grpo_core").parts
        if len(parts) < 2:
            continue  # errors.py, testing.py, __init__.py: not a layer of their own
        pkg = parts[0]
        for name in _imports_of(path):
            other = name.split(".")[1] if name.count(".") >= 1 else None
            if other and other != pkg and (ROOT / "grpo_core" / other).is_dir():
                edges.setdefault(pkg, set()).add(other)
    return edges


# What each layer may not reach, at any depth of a function: the model knows no training, the
# mesh no model, the engines no trainer.
FORBIDDEN = {
    "nn": {"rl", "engines", "stages"},
    "runtime": {"nn", "rl", "engines", "stages"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_only_downwards(package):
    reached = _package_edges().get(package, set()) & FORBIDDEN[package]
    assert not reached, f"grpo_core.{package} imports from {sorted(reached)}"


def test_the_engines_never_import_the_trainer():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "grpo_core" / "engines").rglob("*.py")
        if any(n.startswith("grpo_core.rl.trainer") for n in _imports_of(p))
    ]
    assert not offenders, offenders


def test_config_is_data():
    """config/ imports only config/ and grpo_core.errors: what resolves sources, start points,
    versions and row counts lives above it (grpo_core.store, grpo_core.data, grpo_core.resolve)."""
    reached = _package_edges().get("config", set())
    assert not reached, f"grpo_core.config imports from {sorted(reached)}"


def test_a_config_is_resolved_in_one_place_and_the_path_goes_down():
    """grpo_core.resolve resolves a run's config (versions, start point, rewards, row count) by
    calling down into grpo_core.store and grpo_core.data; nothing in grpo_core calls back up into
    it (the flows, the CLI and the notebook do), and the sources' versions do not resolve the start
    point (grpo_core.store.startpoint.pin, which resolve_run calls beside them)."""
    up = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "grpo_core").rglob("*.py")
        if p.name != "resolve.py" and any(n.startswith("grpo_core.resolve") for n in _imports_of(p))
    ]
    assert up == []
    assert not any(
        n.startswith("grpo_core.store.startpoint") for n in _imports_of(ROOT / "grpo_core/store/versions.py")
    )
    below = {n.split(".")[1] for n in _imports_of(ROOT / "grpo_core" / "resolve.py")}
    assert below == {"config", "data", "errors", "store"}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of packages in `edges` (its first package repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := walk(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := walk(start, [start])):
            return found
    return None


def test_no_circle_between_packages():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself finds one
    assert _cycle({"a": {"b", "c"}, "b": {"c"}}) is None
    circle = _cycle(_package_edges())
    assert circle is None, f"grpo_core's packages import in a circle: {' -> '.join(circle)}"


# -- an import inside a function says why it is not at the top ----------------------------------

_DIRECTIVE = re.compile(r"noqa(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(\[[^\]]*\])?")


def _unexplained_local_imports(source: str) -> list[int]:
    """The lines of the imports inside a function of `source` whose line (the first line of a
    parenthesised import) carries no comment giving a reason: a noqa or type directive alone is none."""
    comments = {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = set()
    for func in ast.walk(ast.parse(source)):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    reason = _DIRECTIVE.sub("", comments.get(node.lineno, "").lstrip("#"))
                    if not re.search(r"[A-Za-z]{2}", reason):
                        lines.add(node.lineno)
    return sorted(lines)


def test_local_imports_say_why():
    """An import stays inside a function only where a boundary needs it (the Prefect side never
    loads JAX, grpo_core never Prefect, a heavy or optional package a command does not need, a
    cycle, an environment variable set first), and its line says which: `# heavy: transformers`,
    `# worker start: JAX`, `# CLI start: Prefect`, `# cycle`."""
    sample = (
        "import os\n"
        "def f():\n"
        "    import a\n"
        "    import b  # noqa: F401\n"
        "    from c import (  # cycle\n"
        "        d,\n"
        "    )\n"
        "    import e  # noqa: F401 - heavy: e\n"
    )
    assert _unexplained_local_imports(sample) == [3, 4]  # the check itself finds them
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in ("grpo_core", "flows", "tasks")
        for path in sorted((ROOT / package).rglob("*.py"))
        for line in _unexplained_local_imports(path.read_text())
    ]
    assert not offenders, f"{len(offenders)} imports inside a function without a reason: " + ", ".join(offenders)
