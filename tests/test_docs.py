"""Every code block in README.md and docs/*.md runs as written (issue 26).

How blocks are checked (one test per block, id ``<doc>:<line>``):

* ```` ```python ````: compiled with ``compile()``; then run in this process with
  ``runpy.run_path(..., run_name="__main__")`` from a scratch directory shared by the blocks
  of one document.  A block whose first line is ``# name.py`` is written to that directory as
  ``name.py`` before any block of the document runs, so later blocks can import it (the
  quickstart's ``scaled.py``).  A block named ``test_*.py`` is run with pytest, as the docs
  say to (in this process); a block in :data:`SCRIPTS` spawns processes and is run as
  ``python name.py`` in a subprocess.  Blocks in :data:`COMPILE_ONLY` are compiled, not run (each with its
  reason); blocks in :data:`MARKS` carry a pytest mark (inductor, distributed, slow).
* ```` ```bash ````: every command line is checked without running anything heavy:
  ``make X`` must be a Makefile target; ``python -m MOD ...`` (``python -m subclass_ca check``,
  ``python -m tools COMMAND``), ``python FILE ...`` and ``torchrun ... FILE ...`` run ``--help``
  of that entry point and every ``--flag`` the doc uses must be in its help; ``bash FILE.sh ...``
  must name a script of the repository, and its flags must be in the help of the
  ``python -m tools COMMAND`` it runs; ``pip install`` lines are not run (they install).
* ```` ```text ```` is output and is not run; an unlabelled fence is an error (label it).

A block's state (handlers it registers, modules it wrote, compiled-autograd caches) is
dropped after it runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import subclass_ca

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "text"}

#: (document, a string unique to the block) -> why the block is only compiled, not run
#: (excerpts of a tested script, blocks that need a GPU or a cluster).
COMPILE_ONLY: dict[tuple[str, str], str] = {
    ("docs/examples.md", "class LoRALinear"): "an excerpt of examples/qlora.py, run whole by tests/examples/",
    ("docs/examples.md", "forward = torch.compile(model"): "an excerpt of examples/qlora.py, run whole by tests/examples/",
    ("docs/integrations.md", "import Trainer  # instead of"): "a trainer's line: tests/integrations/test_transformers.py",
    ("docs/integrations.md", "accelerator.backward(loss)"): "a trainer's line: tests/integrations/test_transformers.py",
    ("docs/integrations.md", "CompiledAutograd()"): "a trainer's line: tests/integrations/test_lightning.py",
    ("docs/integrations.md", "def my_config()"): "a trainer's line (torchtitan trains with CUDA and triton only): "
                                                  "tests/integrations/test_torchtitan.py",
}
#: (document, a string unique to the block): run as ``python <block>.py`` in a subprocess
#: (the block spawns workers, which import its ``__main__`` module: runpy would not do).
SCRIPTS: set[tuple[str, str]] = {
    ("docs/quickstart.md", "# workers.py"),
    ("docs/distributed.md", "# fsdp2_quickstart.py"),
}
#: (document, a string unique to the block) -> pytest marks (CI runs every mark on the default lane).
MARKS: dict[tuple[str, str], list[pytest.MarkDecorator]] = {
    ("README.md", 'backend="inductor"'): [pytest.mark.inductor],                  # ~20-60 s compile
    ("docs/warm_start.md", "save_cache"): [pytest.mark.inductor],                 # ~10-20 s compile
    ("docs/quickstart.md", "# workers.py"): [pytest.mark.distributed],            # 2 processes, ~10 s
    ("docs/distributed.md", "# fsdp2_quickstart.py"): [pytest.mark.distributed],  # 2 x 2 FSDP2 processes, ~40-70 s
    ("docs/quickstart.md", "# check.py"): [pytest.mark.slow],                     # the whole battery, ~15-25 s
    ("docs/quickstart.md", "# test_scaled.py"): [pytest.mark.slow],               # pytest of the battery, ~20-50 s
    ("docs/testing_kit.md", "# test_my_tensor.py"): [pytest.mark.slow],           # pytest of the battery, ~20-50 s
}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def filename(self) -> str | None:
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        match = re.fullmatch(r"#\s*([\w/]+\.py)\s*", first)
        return match.group(1) if match else None


def _blocks(path: Path) -> list[Block]:
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if fence and lang is None:
            lang, start, body = fence.group(1), number, []
        elif fence and lang is not None:
            blocks.append(Block(str(path.relative_to(ROOT)), start, lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{path}: unclosed code fence opened at line {start}"
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in _blocks(doc)]


def _find(table: dict | set, block: Block):
    items = table.items() if isinstance(table, dict) else ((key, True) for key in table)
    return next((value for (doc, needle), value in items if doc == block.doc and needle in block.code), None)


def _params(lang: str) -> list:
    return [pytest.param(b, id=b.id, marks=_find(MARKS, b) or []) for b in ALL_BLOCKS if b.lang == lang]


def test_every_fence_is_labelled_python_bash_or_text():
    bad = [f"{b.id} ```{b.lang}" for b in ALL_BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"label these fences python, bash or text (text is not run): {bad}"


def test_allow_lists_name_real_blocks():
    for table in (COMPILE_ONLY, SCRIPTS, MARKS):
        for doc, needle in table:
            assert [b for b in ALL_BLOCKS if b.doc == doc and needle in b.code], f"no block in {doc} contains {needle!r}"


def test_the_extractor_sees_the_quickstart_blocks():
    """Guard against a vacuous pass."""
    names = [b.filename for b in ALL_BLOCKS if b.doc == "docs/quickstart.md" and b.lang == "python"]
    assert {"scaled.py", "train.py", "check.py", "test_scaled.py"} <= set(names)


# --- python --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doc_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One scratch directory per document, holding its named blocks."""
    dirs = {}
    for doc in DOCS:
        name = str(doc.relative_to(ROOT))
        directory = tmp_path_factory.mktemp(doc.stem)
        for block in ALL_BLOCKS:
            if block.doc == name and block.lang == "python" and block.filename:
                target = directory / block.filename
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.code)
        dirs[name] = directory
    return dirs


@pytest.mark.parametrize("block", _params("python"))
def test_python_block_runs(block: Block, doc_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch):
    code = compile(block.code, block.id, "exec")  # every block at least compiles
    assert code is not None
    if _find(COMPILE_ONLY, block):
        return
    directory = doc_dirs[block.doc]
    script = directory / (block.filename or f"_block_{block.line}.py")
    if not block.filename:
        script.write_text(block.code)
    if script.name.startswith("test_"):  # pytest in this process (as pytester's inprocess runs do)
        monkeypatch.chdir(directory)
        monkeypatch.syspath_prepend(str(directory))
        status = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(directory), script.name])
        assert status == 0, f"{block.id}: pytest {script.name} exited {status} (its output is above)"
        return
    if _find(SCRIPTS, block):
        command = [script.name]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), str(ROOT)]), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, *command], cwd=directory, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{block.id}: python {' '.join(command)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
        return
    monkeypatch.chdir(directory)
    monkeypatch.syspath_prepend(str(directory))
    registered = set(subclass_ca.handlers())
    modules = set(sys.modules)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        for cls in set(subclass_ca.handlers()) - registered:
            subclass_ca.unregister_handler(cls)
        for name in set(sys.modules) - modules:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(directory)):
                del sys.modules[name]


# --- bash ----------------------------------------------------------------------------------


def _commands(code: str) -> list[list[str]]:
    text = re.sub(r"\\\n", " ", code)
    commands = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|\|\|", line):
            if part.strip():
                commands.append(shlex.split(part))
    return commands


def _entry_point(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """(the command that prints the entry point's help, the arguments the doc passes), or None."""
    if argv[0] == "torchrun":
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        return [sys.executable, argv[script]], argv[script + 1:]
    if argv[0] in ("bash", "sh") and argv[1].endswith(".sh"):
        script = ROOT / argv[1]
        assert script.is_file(), f"no script {argv[1]} in the repository"
        runs = re.search(r"-m tools ([\w-]+)", script.read_text())
        assert runs, f"{argv[1]} runs no `python -m tools COMMAND`: don't know how to check its flags"
        return [sys.executable, "-m", "tools", runs.group(1)], argv[2:]
    if argv[0] not in ("python", "python3"):
        return None
    if argv[1] == "-m":
        module, rest = argv[2], argv[3:]
        prefix = [sys.executable, "-m", module]
        if module in ("subclass_ca", "tools") and rest and not rest[0].startswith("-"):
            prefix, rest = [*prefix, rest[0]], rest[1:]
            if prefix[-1] == "versions" and rest and not rest[0].startswith("-"):
                prefix, rest = [*prefix, rest[0]], rest[1:]
        return prefix, rest
    return [sys.executable, argv[1]], argv[2:]


_HELP: dict[tuple[str, ...], str] = {}


def _help(prefix: list[str]) -> str:
    """The entry point's ``--help`` text, run in this process (torch is imported already)."""
    key = tuple(prefix)
    if key not in _HELP:
        target, rest = (prefix[2], prefix[3:]) if prefix[1] == "-m" else (prefix[1], prefix[2:])
        out = io.StringIO()
        with contextlib.redirect_stdout(out), _argv([target, *rest, "--help"]), pytest.raises(SystemExit) as exit_info:
            if target == "subclass_ca":
                from subclass_ca.__main__ import main

                sys.exit(main([*rest, "--help"]))
            elif target == "tools":
                from tools.__main__ import main as tools_main

                sys.exit(tools_main([*rest, "--help"]))
            elif prefix[1] == "-m":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / target), run_name="__main__")
        assert exit_info.value.code in (0, None), f"{' '.join(prefix[1:])} --help exited {exit_info.value.code}"
        _HELP[key] = out.getvalue()
    return _HELP[key]


@contextlib.contextmanager
def _argv(argv: list[str]):
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def _unknown_flags(prefix: list[str], args: list[str]) -> list[str]:
    usage = _help(prefix)
    flags = [a.split("=")[0] for a in args if a.startswith("--")]
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", usage)]


def test_the_flag_check_catches_a_flag_the_entry_point_lacks():
    """Guard against a vacuous pass: the old docs' ``--modes`` (the flag is ``--fsdp2-modes``)."""
    prefix, args = _entry_point(shlex.split("python -m tools fsdp2 --nproc 2 --modes eager --fsdp2-steps 2"))
    assert prefix[-2:] == ["tools", "fsdp2"]
    assert _unknown_flags(prefix, args) == ["--modes"]
    prefix, args = _entry_point(shlex.split("bash tools/gpu/device_check.sh --dry-run --bogus"))
    assert prefix[-2:] == ["tools", "gpu-check"]
    assert _unknown_flags(prefix, args) == ["--bogus"]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


@pytest.mark.parametrize("block", _params("bash"))
def test_bash_block_commands_exist(block: Block):
    checked = 0
    for argv in _commands(block.code):
        if argv[0] == "make":
            targets = [a for a in argv[1:] if "=" not in a] or ["all"]
            missing = [t for t in targets if t not in _make_targets()]
            assert not missing, f"{block.id}: no Makefile target {missing}"
        elif argv[0] == "pip":
            continue  # installs: not run here
        else:
            entry = _entry_point(argv)
            assert entry is not None, f"{block.id}: don't know how to check {argv}"
            unknown = _unknown_flags(*entry)
            assert not unknown, f"{block.id}: `{' '.join(argv)}` passes {unknown}, not in `{' '.join(entry[0][1:])} --help`"
        checked += 1
    assert checked or "pip install" in block.code
