"""The architecture's two import rules (docs/design.md), checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "subclass_ca"
TOOLING = ("_tools", "testing", "__main__", "distributed")
RUNTIME_MODULES = sorted(
    p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0].removesuffix(".py") not in TOOLING
)
ALL_MODULES = sorted(PACKAGE.rglob("*.py"))
#: The reference zoo is written the way users write subclasses (torch.utils._pytree in __torch_dispatch__).
PRIVATE_TORCH_EXEMPT = {PACKAGE / "testing" / "subclasses.py"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def _private_torch_uses(path: Path) -> list[str]:
    """``torch._x`` / ``torch.a._x`` in imports and attribute chains (docstrings and comments excluded)."""
    tree = ast.parse(path.read_text())
    found = []
    for name in _imported(path):
        if name.startswith("torch.") and any(part.startswith("_") and not part.startswith("__") for part in name.split(".")[1:]):
            found.append(f"import {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            current: ast.AST = node
            while isinstance(current, ast.Attribute):
                chain.append(current.attr)
                current = current.value
            if isinstance(current, ast.Name) and current.id == "torch":
                chain.reverse()
                private = [p for p in chain if p.startswith("_") and not p.startswith("__")]
                if private:
                    found.append(f"torch.{'.'.join(chain)} (line {node.lineno})")
    return sorted(set(found))


@pytest.mark.parametrize("path", RUNTIME_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_runtime_never_imports_tooling(path: Path):
    tooling = [n for n in _imported(path) if n.startswith(("subclass_ca._tools", "subclass_ca.testing", "subclass_ca.__main__", "subclass_ca.distributed"))]
    assert not tooling, f"{path.relative_to(PACKAGE)} imports tooling: {tooling}"


@pytest.mark.parametrize("path", ALL_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_compat_package_touches_torch_privates(path: Path):
    if path.relative_to(PACKAGE).parts[0] == "_compat" or path in PRIVATE_TORCH_EXEMPT:
        return
    uses = _private_torch_uses(path)
    assert not uses, f"{path.relative_to(PACKAGE)} reaches torch internals outside subclass_ca._compat: {uses}"


def test_compat_and_errors_import_nothing_of_ours_but_each_other():
    for path in [*sorted((PACKAGE / "_compat").glob("*.py")), PACKAGE / "errors.py"]:
        ours = {n for n in _imported(path) if n.startswith("subclass_ca") and not n.startswith("subclass_ca._compat")}
        assert ours <= {"subclass_ca.errors", "subclass_ca.errors.UnsupportedTorchError"}, (path.name, ours)


def test_the_rules_really_see_imports():
    """Guard against a vacuous pass: the checker finds what we know is there."""
    assert "subclass_ca._compat" in _imported(PACKAGE / "_runtime.py")
    assert "subclass_ca._runtime" in _imported(PACKAGE / "api.py")
    assert any("torch._C" in use for use in _private_torch_uses(PACKAGE / "_compat" / "__init__.py"))
    assert "subclass_ca.api" in _imported(PACKAGE / "_tools" / "bench.py")
