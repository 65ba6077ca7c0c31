"""Installing subclass_ca into an environment that already holds torch never changes that torch (issues 26.2, 37).

The wheel declares no torch requirement at all (the ecosystem's convention: torchao and torchtune
declare none either), so pip has nothing to resolve about torch, whatever torch is there or not.
Builds the wheel from this checkout, makes a fresh venv that *sees* this lane's packages (a
``.pth`` line pointing at the running interpreter's site-packages: torch 2.13, 2.14 or 2.15 is
"already installed" there), and installs the wheel with its extras from no index at all: if pip
wanted a different torch it would have to fetch one and fail.  Then torch's version and files
must be exactly the lane's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT))
    (found,) = out.glob("subclass_ca-*.whl")
    return found


def test_pip_install_into_an_environment_with_torch_keeps_that_torch(wheel: Path, tmp_path: Path):
    env_dir = tmp_path / "user-env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    # the user's existing packages (this lane's torch, typing-extensions, the extras' deps)
    (purelib / "lane.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip_env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip_env.pop("PIP_CONSTRAINT", None)
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", f"{wheel}[demo,torchao]", env=pip_env)

    report = json.loads(
        _run(
            str(python),
            "-c",
            "import json, torch, subclass_ca; print(json.dumps({'torch': torch.__version__, "
            "'torch_file': torch.__file__, 'subclass_ca': subclass_ca.__file__}))",
            cwd=tmp_path,  # not the checkout: import what pip installed
        )
    )
    assert report["torch"] == torch.__version__  # unchanged: the lane's own torch
    assert Path(report["torch_file"]).resolve() == Path(torch.__file__).resolve()
    assert Path(report["subclass_ca"]).resolve().is_relative_to(purelib.resolve())  # the wheel, not this checkout
    assert not list(purelib.glob("torch-*.dist-info")), "pip installed a torch into the user's environment"


def test_the_wheel_declares_no_torch_requirement(wheel: Path):
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        requirements = [
            line.split(":", 1)[1].strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    assert requirements, "METADATA lists no requirement at all: the wheel was not built from pyproject.toml"
    assert not [r for r in requirements if r.split()[0].split(";")[0].strip().lower() in ("torch", "pytorch")]


def test_pip_install_into_an_environment_with_an_unsupported_torch_keeps_it_and_enable_refuses(wheel: Path, tmp_path: Path):
    """A user on torch 2.10 (outside the supported range) installs: pip leaves their torch alone.

    The environment's torch is this lane's real torch reporting itself as 2.10.0 (a copy of the
    lane's site-packages entry for torch would be gigabytes): pip sees an installed
    ``torch 2.10.0`` distribution, and the import reports ``torch.__version__ == "2.10.0"``.
    """
    env_dir = tmp_path / "old-torch-env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    lane = Path(sysconfig.get_paths()["purelib"])
    # torch 2.10.0 as pip sees it: a distribution record, and the lane's torch behind it
    (purelib / "lane.pth").write_text(f"{lane}\nimport _old_torch_version\n")
    (purelib / "_old_torch_version.py").write_text(
        "import sys\n"
        "class _Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'torch':\n"
        "            return None\n"
        "        sys.meta_path.remove(self)\n"
        "        import importlib.util\n"
        "        spec = importlib.util.find_spec('torch')\n"
        "        loader = spec.loader\n"
        "        class _Loader:\n"
        "            def create_module(self, spec):\n"
        "                return loader.create_module(spec)\n"
        "            def exec_module(self, module):\n"
        "                loader.exec_module(module)\n"
        "                module.__version__ = '2.10.0'\n"
        "        spec.loader = _Loader()\n"
        "        return spec\n"
        "sys.meta_path.insert(0, _Finder())\n"
    )
    dist_info = purelib / "torch-2.10.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    (dist_info / "RECORD").write_text("")
    pip_env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip_env.pop("PIP_CONSTRAINT", None)
    listed_before = _run(sys.executable, "-m", "pip", "--python", str(python), "list", "--format=json", "--path", str(purelib), env=pip_env)
    assert {"name": "torch", "version": "2.10.0"} in json.loads(listed_before)
    # typing-extensions, the one runtime requirement, is the lane's (seen through lane.pth) as it would be beside any torch
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", str(wheel), env=pip_env)
    listed_after = json.loads(
        _run(sys.executable, "-m", "pip", "--python", str(python), "list", "--format=json", "--path", str(purelib), env=pip_env)
    )
    assert {"name": "torch", "version": "2.10.0"} in listed_after, "installing subclass_ca changed the user's torch"
    assert any(entry["name"] == "subclass_ca" for entry in listed_after)

    probe = (
        "import json, torch, subclass_ca\n"
        "from subclass_ca.testing.subclasses import make_pair\n"
        "weight = torch.nn.Parameter(make_pair(torch.randn(4, 4)))\n"
        "loss = (torch.randn(2, 4) @ weight).sum()\n"
        "try:\n"
        "    with subclass_ca.enable():\n"
        "        loss.backward()\n"
        "    outcome = 'ran'\n"
        "except subclass_ca.UnsupportedTorchError as error:\n"
        "    outcome = str(error)\n"
        "print(json.dumps({'torch': torch.__version__, 'outcome': outcome, 'grad': weight.grad is not None}))\n"
    )
    report = json.loads(_run(str(python), "-c", probe, cwd=tmp_path).strip().splitlines()[-1])
    assert report["torch"] == "2.10.0"
    assert "found torch 2.10.0" in report["outcome"] and ">=2.11" in report["outcome"], report["outcome"]
    assert report["grad"] is False, "a backward ran under an unsupported torch"
