"""Installing subclass_ca into an environment that already holds torch never changes that torch (issue 26.2).

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
