"""``python -m subclass_ca check``: table and exit 0 on the zoo, exit 1 naming a broken subclass, exit 2 on usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from subclass_ca.testing import _cli
from subclass_ca.testing.scenarios import scenario_names

REPO = Path(__file__).resolve().parents[2]


def _check(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "subclass_ca", "check", "--no-progress", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_check_on_the_zoo_prints_the_table_writes_json_and_exits_0(tmp_path):
    out = tmp_path / "report.json"
    run = _check("--no-builtin", "--no-torchao", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split() == ["scenario", "pair", "nested_pair", "int8", "chunked", "tagged"]
    rows = {line.split()[0]: line for line in lines[2:2 + len(scenario_names())]}
    assert set(rows) == set(scenario_names())
    assert rows["param_grad"].count("✓") == 5
    assert "✗" not in run.stdout
    assert "subclass_ca check: " in lines[-1] and " 0 failed" in lines[-1]
    data = json.loads(out.read_text())
    assert data["summary"]["fail"] == 0
    assert len(data["results"]) == 5 * len(scenario_names())
    assert {r["subclass"] for r in data["results"]} == {"pair", "nested_pair", "int8", "chunked", "tagged"}


def test_check_on_a_module_with_a_broken_subclass_exits_1_and_names_it():
    run = _check("--module", "tests.testing.kit_broken", "--subclass", "scale_dropping_int8,tag_forgetting",
                 "--scenario", "param_grad,metadata_change")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED scale_dropping_int8 / param_grad [aot_eager, cpu]:" in run.stdout
    assert "FAILED tag_forgetting / metadata_change [aot_eager, cpu]:" in run.stdout
    assert "FAILED tag_forgetting / param_grad" not in run.stdout
    assert "✗" in run.stdout


def test_registered_subclass_without_a_factory_is_listed_as_skipped(capsys):
    import torch

    import subclass_ca

    class Unlisted(torch.Tensor):
        def __tensor_flatten__(self):
            return [], None

        @staticmethod
        def __tensor_unflatten__(inner, ctx, size, stride):
            raise NotImplementedError

    subclass_ca.register_handler(Unlisted)
    try:
        assert _cli.main(["--no-zoo", "--no-builtin", "--list"]) == 0
        assert "Unlisted (no factory)" in capsys.readouterr().out
    finally:
        subclass_ca.unregister_handler(Unlisted)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--module", "no_such_module_xyz"], "--module no_such_module_xyz: cannot import it"),
        (["--subclass", "nope"], "unknown subclass 'nope'; choose from: "),
        (["--backend", "not_a_backend"], "unknown backend 'not_a_backend'; choose from: "),
        (["--device", "potato"], "unknown device 'potato'"),
        (["--scenario", "nope"], "unknown scenario 'nope'; choose from: param_grad"),
        (["--json", "/no/such/dir/report.json"], "its directory does not exist"),
        (["--no-zoo", "--no-builtin", "--no-torchao"], "nothing to check"),
        (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message(argv, message, capsys):
    assert _cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_module_with_a_malformed_factories_attribute_is_a_usage_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad_factories_mod.py").write_text("SUBCLASS_CA_FACTORIES = ['not', 'a', 'dict']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cli.main(["--module", "bad_factories_mod"]) == 2
    assert "SUBCLASS_CA_FACTORIES must be a dict name -> factory, got list" in capsys.readouterr().err


def test_list_names_zoo_builtins_and_module_factories(capsys):
    assert _cli.main(["--module", "tests.testing.kit_broken", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("scale_dropping_int8", "tag_forgetting", "two_tensor", "dtensor", "pair", "tagged"):
        assert name in out


def test_help_exits_0_and_documents_the_factories_attribute(capsys):
    assert _cli.main(["--help"]) == 0
    assert "SUBCLASS_CA_FACTORIES" in capsys.readouterr().out
