"""Prove that the product runs on its runtime dependencies alone: `[project] dependencies` in
pyproject.toml, not an extra (issue 12: the demo died on `httpx`, which only the test extra
installed).

Run it with the interpreter of an environment where Inferno is installed (`.venv/bin/python
.ci/runtime_imports.py`). Two checks, since an extra installed beside the runtime (the demo's
`openai` and what it depends on) can hide a missing runtime dependency from a plain import:

1. Every import statement in the product's source (appliance, attestation, audit, installer,
   kernels), in function bodies too, and every `importlib.import_module("...")` of a constant
   name, names the standard library, the product itself, or a module that a distribution in
   the runtime closure provides (the runtime requirements of `inferno`, recursively, markers
   evaluated).
2. Every module of the product imports.

The one exception, for its documented reason: `triton`, the `gpu` extra, which only the Triton
kernels import (kernels/backend.py loads them on a CUDA device only); modules that need it are
skipped where it is not installed.

Exit status 0 when both checks pass; 1, with one line per problem, otherwise.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as metadata
import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PACKAGES = ("appliance", "attestation", "audit", "installer", "kernels")
DISTRIBUTION = "inferno"
# Imported outside the runtime dependencies, with the reason, and where.
OPTIONAL = {"triton": ("the gpu extra: the Triton kernels load on a CUDA device only", "kernels")}


def runtime_closure(distribution: str) -> set[str]:
    """The canonical names of `distribution`'s runtime requirements, recursively (with the
    extras each requirement asks of the next, as `pyjwt[crypto]`), markers evaluated here."""
    closure: set[str] = set()
    todo = [(distribution, frozenset[str]())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        closure.add(canonicalize_name(name))
        for text in metadata.requires(name) or ():
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((requirement.name, frozenset(requirement.extras)))
    closure.discard(canonicalize_name(distribution))
    return closure


def imports_in(path: Path) -> Iterator[tuple[int, str]]:
    """(line, top-level module) of every absolute import in the file, and of every
    `import_module("name")` with a constant name."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value.split(".")[0]


def check_sources(root: Path, closure: set[str]) -> list[str]:
    providers = metadata.packages_distributions()
    problems = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imports_in(path):
                if module in sys.stdlib_module_names or module in (*PACKAGES, "__future__"):
                    continue
                if module in OPTIONAL and path.relative_to(root).parts[0] == OPTIONAL[module][1]:
                    continue
                dists = sorted({canonicalize_name(d) for d in providers.get(module, ())})
                if not closure.intersection(dists):
                    where = path.relative_to(root)
                    given = f"distribution {', '.join(dists)}" if dists else "not installed"
                    problems.append(
                        f"{where}:{line} imports {module} ({given}), which no runtime dependency "
                        "provides: add it to [project] dependencies in pyproject.toml"
                    )
    return problems


def import_every_module() -> tuple[int, list[str], list[str]]:
    """(modules imported, modules skipped with the reason, problems)."""
    num_imported, skipped, problems = 0, [], []
    for package in PACKAGES:
        names = [package]
        path = importlib.import_module(package).__path__
        names += [info.name for info in pkgutil.walk_packages(path, package + ".", print)]
        for name in names:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                top = (exc.name or "").split(".")[0]
                if top in OPTIONAL and name.split(".")[0] == OPTIONAL[top][1]:
                    skipped.append(f"{name} (needs {top}: {OPTIONAL[top][0]})")
                else:
                    problems.append(f"{name} does not import: {exc}")
            except Exception as exc:
                problems.append(f"{name} does not import: {type(exc).__name__}: {exc}")
            else:
                num_imported += 1
    return num_imported, skipped, problems


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    closure = runtime_closure(DISTRIBUTION)
    problems = check_sources(root, closure)
    num_imported, skipped, import_problems = import_every_module()
    problems += import_problems
    for line in skipped:
        print(f"runtime imports: skipped {line}")
    for line in problems:
        print(f"runtime imports: FAILED: {line}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"runtime imports: OK: {num_imported} modules of {', '.join(PACKAGES)} import, and "
        f"every import in their source is the standard library's or a runtime dependency's "
        f"({len(closure)} distributions)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
