"""The architecture's import rules (docs/design.md), checked on the source.

The runtime never imports the package's tooling (``testing``, ``__main__``, ``distributed``, ``integrations``), the
trainer integrations use the public API only, nothing in the
package imports the repository's tools (``tools/``, not packaged), and only ``_compat`` touches torch privates.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "subclass_ca"
TOOLS = ROOT / "tools"
TOOLING = ("testing", "__main__", "distributed", "integrations")
RUNTIME_MODULES = sorted(
    p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0].removesuffix(".py") not in TOOLING
)
ALL_MODULES = sorted(PACKAGE.rglob("*.py"))
#: The reference zoo is written the way users write subclasses (torch.utils._pytree in __torch_dispatch__).
PRIVATE_TORCH_EXEMPT = {PACKAGE / "testing" / "subclasses.py"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
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
    tooling = [n for n in _imported(path) if n.startswith(("subclass_ca.testing", "subclass_ca.__main__", "subclass_ca.distributed"))]
    assert not tooling, f"{path.relative_to(PACKAGE)} imports tooling: {tooling}"


@pytest.mark.parametrize("path", ALL_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_compat_package_touches_torch_privates(path: Path):
    if path.relative_to(PACKAGE).parts[0] == "_compat" or path in PRIVATE_TORCH_EXEMPT:
        return
    uses = _private_torch_uses(path)
    assert not uses, f"{path.relative_to(PACKAGE)} reaches torch internals outside subclass_ca._compat: {uses}"


INTEGRATIONS = sorted((PACKAGE / "integrations").glob("*.py"))


@pytest.mark.parametrize("path", INTEGRATIONS, ids=lambda p: p.name)
def test_the_trainer_integrations_use_the_public_api_only(path: Path):
    """They are what a user would write (docs/integrations.md): ``import subclass_ca`` and its public names."""
    ours = sorted(n for n in _imported(path) if n.startswith("subclass_ca") and n != "subclass_ca"
                  and not n.startswith("subclass_ca.integrations"))
    assert not ours, f"integrations/{path.name} imports {ours}: use the public API (subclass_ca.enable, Config)"
    assert "subclass_ca" in _imported(path) or path.name == "__init__.py"


def test_compat_and_errors_import_nothing_of_ours_but_each_other():
    for path in [*sorted((PACKAGE / "_compat").glob("*.py")), PACKAGE / "errors.py"]:
        ours = {n for n in _imported(path) if n.startswith("subclass_ca") and not n.startswith("subclass_ca._compat")}
        assert ours <= {"subclass_ca.errors", "subclass_ca.errors.UnsupportedTorchError"}, (path.name, ours)


def test_the_rules_really_see_imports():
    """Guard against a vacuous pass: the checker finds what we know is there."""
    assert "subclass_ca._compat" in _imported(PACKAGE / "_runtime.py")
    assert "subclass_ca._runtime" in _imported(PACKAGE / "api.py")
    assert any("torch._C" in use for use in _private_torch_uses(PACKAGE / "_compat" / "__init__.py"))
    assert "subclass_ca.api" in _imported(TOOLS / "bench" / "main.py")
    assert "tools.bench.models" in _imported(TOOLS / "bench" / "main.py")  # a tool's relative imports resolve to `tools`
    assert "tools.common.report" in _imported(TOOLS / "fsdp2" / "parity.py")


@pytest.mark.parametrize("path", ALL_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_package_never_imports_the_repository_tools(path: Path):
    """``tools/`` is not in the wheel (tests/test_wheel.py): an installed subclass_ca importing it would fail."""
    tools = [n for n in _imported(path) if n == "tools" or n.startswith("tools.")]
    assert not tools, f"{path.relative_to(PACKAGE)} imports the repository's tools: {tools}"


def test_the_tools_live_in_the_repository_not_in_the_package():
    assert not (PACKAGE / "_tools").exists() and not list(PACKAGE.rglob("_tools"))
    assert (TOOLS / "bench" / "main.py").is_file() and (TOOLS / "__main__.py").is_file()
    assert not (TOOLS.parent / "subclass_ca" / "tools").exists()


#: The repository's tools that sit below others: what of ``tools`` each may import (issue 63: ``bench`` and ``fsdp2``
#: imported each other; what both need lives in ``tools.common``, and ``bench`` may use ``fsdp2``'s runs).
TOOL_LAYERS = {"common": ("tools.common",), "fsdp2": ("tools.common", "tools.fsdp2")}


@pytest.mark.parametrize("path", [p for layer in TOOL_LAYERS for p in sorted((TOOLS / layer).glob("*.py"))],
                         ids=lambda p: str(p.relative_to(TOOLS)))
def test_the_shared_tools_never_import_the_tools_above_them(path: Path):
    allowed = TOOL_LAYERS[path.parent.name]
    above = sorted(n for n in _imported(path) if (n == "tools" or n.startswith("tools.")) and not n.startswith(allowed))
    assert not above, f"tools/{path.relative_to(TOOLS)} imports {above}: move what it needs into tools.common"


def test_the_tool_layer_rule_really_sees_imports():
    assert "tools.common.models" in _imported(TOOLS / "fsdp2" / "parity.py")
    assert "tools.fsdp2.runs" in _imported(TOOLS / "bench" / "fsdp2.py")  # bench may use fsdp2


#: Modules outside ``_compat`` that may use regular expressions or Python's parsers, and for what (never torch's
#: error text: every reading of torch's messages lives in ``_compat/messages.py``, tested per lane).
TEXT_PARSING_ALLOWED = {
    "_warm_start/fingerprint.py": "scrubs memory addresses out of reprs it fingerprints (our text, not torch's)",
    "_nodes.py": "makes an identifier of a class name",
    "testing/_cli.py": "the kit's command line (its own arguments)",
    "testing/suite.py": "the kit's own reports",
}
TEXT_PARSERS = {"re", "ast", "tokenize"}


@pytest.mark.parametrize("path", ALL_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_torch_messages_are_parsed_only_in_compat(path: Path):
    relative = path.relative_to(PACKAGE)
    if relative.parts[0] == "_compat" or str(relative) in TEXT_PARSING_ALLOWED:
        return
    parsers = sorted(n for n in _imported(path) if n.split(".")[0] in TEXT_PARSERS)
    assert not parsers, (
        f"{relative} imports {parsers}: reading torch's error text belongs in subclass_ca/_compat/messages.py "
        "(or list the module in TEXT_PARSING_ALLOWED with what it parses)"
    )


def _root_attribute_imports(path: Path) -> list[str]:
    """Names ``path`` takes from the package's ``__init__`` (``import subclass_ca``, or ``from subclass_ca import x``
    / ``from . import x`` where ``x`` is not a submodule)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name == "subclass_ca"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base != "subclass_ca":
                continue
            for alias in node.names:
                if not ((PACKAGE / f"{alias.name}.py").is_file() or (PACKAGE / alias.name).is_dir()):
                    found.append(f"subclass_ca.{alias.name}")
    return found


@pytest.mark.parametrize("path", RUNTIME_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_upward_imports_from_the_package_root(path: Path):
    """A runtime module never takes anything from the package's ``__init__`` (the front door): the arrows point down."""
    if path == PACKAGE / "__init__.py":
        return
    upward = _root_attribute_imports(path)
    assert not upward, f"{path.relative_to(PACKAGE)} imports from the package root: {upward}"


def test_the_upward_rule_really_sees_root_imports(tmp_path: Path):
    assert _root_attribute_imports(PACKAGE / "testing" / "suite.py") == ["subclass_ca"]  # the kit may: public API


def test_no_submodule_name_is_rebound_to_something_else():
    """``subclass_ca.X`` is the module X whenever the package has a module X (``handler``/``handlers`` were
    functions shadowing their modules)."""
    import importlib

    import subclass_ca

    for path in sorted(PACKAGE.iterdir()):
        name = path.stem if path.suffix == ".py" else path.name
        if name.startswith("__") or not (path.suffix == ".py" or (path / "__init__.py").is_file()):
            continue
        module = importlib.import_module(f"subclass_ca.{name}")
        value = getattr(subclass_ca, name)
        assert value is module, f"subclass_ca.{name} is {value!r}, not the module subclass_ca/{path.name}"


def _design_table() -> dict[str, set[str]]:
    """docs/design.md's module map: runtime module file -> the modules of ours it may import."""
    import re

    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    allowed: dict[str, set[str]] = {}
    for line in design.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`") or cells[0].startswith("`_compat/"):
            continue
        may = {m.strip("`/").removesuffix(".py") for m in re.findall(r"`([\w/.]+)`", cells[2])}
        for module in re.findall(r"`([\w/.]+)`", cells[0]):
            allowed[module.strip("/").removesuffix(".py")] = may
    return allowed


def test_every_runtime_module_imports_only_what_the_design_table_allows():
    """docs/design.md's module map is the rule: a runtime module not in it, or importing beyond it, fails."""
    allowed = _design_table()
    assert "_runtime" in allowed and "_translate" in allowed  # the table was read
    for path in RUNTIME_MODULES:
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "_compat" or relative.name == "__init__.py":
            continue
        name = relative.parts[0].removesuffix(".py")
        assert name in allowed, f"{relative} is missing from docs/design.md's module map"
        ours = {n.split(".")[1] for n in _imported(path) if n.startswith("subclass_ca.")} - {name}
        extra = ours - allowed[name]
        assert not extra, f"{relative} imports {sorted(extra)}, which docs/design.md's module map does not allow it"


def _compat_attributes_used(path: Path) -> set[str]:
    """``_compat.X`` in ``path`` (the facade's names the module uses)."""
    tree = ast.parse(path.read_text())
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_compat"}


def test_the_compat_facade_exports_every_name_the_package_uses_and_derives_its_list():
    """``_compat.__all__`` is derived from the area modules' own lists (issue 63: three hand-kept lists had drifted):
    every ``_compat.X`` the package uses is exported, and each area's list is part of it."""
    from subclass_ca import _compat

    used = set().union(*(_compat_attributes_used(p) for p in ALL_MODULES if p.parent.name != "_compat"))
    assert used, "the check sees no use of _compat: it would pass vacuously"
    assert not used - set(_compat.__all__), f"used through _compat but not exported: {sorted(used - set(_compat.__all__))}"
    for area in ("accumulate", "aot_autograd", "caches", "compiled_autograd", "dynamo", "workarounds", "version"):
        module = getattr(_compat, area, None) or __import__(f"subclass_ca._compat.{area}", fromlist=["__all__"])
        assert set(module.__all__) <= set(_compat.__all__), area
    source = (PACKAGE / "_compat" / "__init__.py").read_text()
    assert "from .caches import *" in source and "__all__ += caches.__all__" in source
