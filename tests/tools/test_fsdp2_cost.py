"""``fsdp2-cost``: an FSDP2 backward's time split into compiled autograd itself and the compiled pieces' entries.

One launch on a world of 1 (no collectives) times the micro MLP's backward in the four modes
for a few rounds and checks every mode's gradients against eager FSDP2's (bitwise on aot_eager:
running the pieces uncompiled changes no value). Timing values are not asserted (noisy machine);
their presence, signs of life and the derived figures' arithmetic are.
"""

from __future__ import annotations

import math
import statistics

import pytest

from tools.__main__ import usage as _usage
from tools.fsdp2 import cost

SETTINGS = cost.FSDP2Cost(models=("micro", "block_nf4_lora"), backends=("aot_eager",), reps=3, block=1, warmup=0)


@pytest.fixture(scope="module")
def result() -> dict:
    return cost.measure(1, settings=SETTINGS, timeout_s=170)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_every_mode_is_timed_and_bitwise_equal_to_eager_fsdp2(result):
    micro = next(r for r in result["rows"] if r["model"] == "micro")
    assert result["ok"], result["rows"]
    assert list(micro["modes"]) == list(cost.MODES)
    for name, mode in micro["modes"].items():
        assert mode["correct"] and mode["max_abs_diff"] == 0.0, (name, mode["problems"])
        assert mode["median_ms"] > 0 and all(math.isfinite(x) for x in mode["iqr_ms"])
    assert micro["pieces"] >= 3 and micro["hooks"] >= 3  # one piece per layer at least, FSDP2's hooks between
    assert micro["modes"]["eager"]["ratio"] == 1.0


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_derived_costs_are_reported_in_text_and_markdown(result):
    micro = next(r for r in result["rows"] if r["model"] == "micro")
    assert set(micro["ca_floor_ms"]) == {"median", "iqr"} and set(micro["piece_entry_us"]) == {"median", "iqr"}
    low, high = micro["piece_entry_us"]["iqr"]
    assert low <= micro["piece_entry_us"]["median"] <= high
    text = cost.format_summary(result)
    assert f"micro, aot_eager: {micro['pieces']} compiled pieces" in text
    assert "compiled autograd before any compiler (ca_uncompiled - compile)" in text
    section = cost.markdown_section(result, command="python -m tools fsdp2-cost --models micro")
    assert "| micro | aot_eager | ca_uncompiled |" in section
    assert "Command: `python -m tools fsdp2-cost --models micro`" in section


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_nf4_row_on_a_world_of_one_is_skipped_with_the_reason(result):
    nf4 = next(r for r in result["rows"] if r["model"] == "block_nf4_lora")
    assert "modes" not in nf4
    assert "world of 1" in nf4["skipped"] or "torchao" in nf4["skipped"].lower()


def test_quartiles_of_the_derived_figures_match_statistics() -> None:
    row = {"model": "m", "backend": "b", "pieces": 2, "hooks": 2, "modes": {
        name: {"samples_ms": samples, "ratios": [1.0] * 3, "problems": [], "max_abs_diff": 0.0}
        for name, samples in {"eager": [1.0, 1.0, 1.0], "compile": [1.0, 1.1, 1.2],
                              "subclass_ca": [2.0, 2.4, 2.2], "ca_uncompiled": [1.5, 1.6, 1.7]}.items()}}
    summary = cost._summarize_row([row])
    assert summary["ca_floor_ms"]["median"] == pytest.approx(statistics.median([0.5, 0.5, 0.5]))
    assert summary["piece_entry_us"]["median"] == pytest.approx(statistics.median([250.0, 400.0, 250.0]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"models": ("nope",)}, "FSDP2Cost.models: unknown"),
        ({"backends": ()}, "must not be empty"),
        ({"reps": 0}, "FSDP2Cost.reps must be a positive int"),
        ({"warmup": -1}, "FSDP2Cost.warmup must be an int >= 0"),
        ({"device": "tpu"}, "FSDP2Cost.device: got 'tpu'"),
    ],
)
def test_settings_are_validated(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        cost.FSDP2Cost(**kwargs)


def test_cli_rejects_an_unknown_model_and_is_listed(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cost.main(["--models", "nope"])
    assert exit_info.value.code == 2
    assert "FSDP2Cost.models: unknown ['nope']" in capsys.readouterr().err
    assert "fsdp2-cost" in _usage()
