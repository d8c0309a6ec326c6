"""Every ``from layerfreeze... import name`` and ``from benchmarks... import name`` in the library, the benchmarks, the
examples and the tests names something that exists, also the imports inside functions, which only run when the
function does (``benchmarks.adaptivity`` imported ``freeze_steps`` from where it had moved out of, and no test ran
that function: the script failed at its first run)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("src/layerfreeze", "benchmarks", "examples", "tests")


def _imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) of every ``from <ours> import name`` in the folders."""
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] in ("layerfreeze", "benchmarks"):
                    found += [(str(path.relative_to(ROOT)), node.lineno, node.module, a.name) for a in node.names]
    return found


def test_every_import_of_ours_names_something_that_exists():
    imports = _imports()
    assert len(imports) > 500  # the walk found the files
    missing = []
    for file, line, module, name in imports:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] not in ("layerfreeze", "benchmarks"):
                continue  # an optional dependency of that module (peft, diffusers, ...): not ours to check here
            missing.append(f"{file}:{line}: no module {module}")
            continue
        if name != "*" and not hasattr(mod, name):
            try:  # a submodule: `from layerfreeze.compute import frozen`
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{file}:{line}: {module} has no {name}")
    assert missing == [], "\n".join(missing)

