"""Stock parity: run one scenario under eager, stock compiled autograd and ``subclass_ca.enable()``.

A *scenario* is a small function ``scenario(env) -> dict`` of plain-tensor training code.  It
asks ``env`` for everything that differs between the runs:

* ``env.ca()`` — the compiled-autograd context around a backward (eager: nothing; stock:
  ``torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend=...,
  fullgraph=True))``; ours: ``subclass_ca.enable(backend=...)``);
* ``env.compile(fn)`` — the forward (eager: ``fn`` itself; otherwise ``torch.compile(fn,
  backend=...)``), so the autograd graph holds AOT-compiled backward nodes;
* ``env.attempt(fn)`` — runs ``fn`` and returns ``"ok"`` or ``"<ExceptionType>: <first
  line>"``, for scenarios that expect one step to fail and the next one to work.

It returns what it observed (gradients, parameters, losses, hook call counts, attempt
results) as a dict; :func:`assert_same_outcome` compares two of them leaf by leaf, tensors
bitwise.  :func:`run_both` runs the stock and the subclass_ca run of one scenario, each from
fresh Dynamo / compiled-autograd caches and counters, with the same seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters

import subclass_ca
from subclass_ca import _compat

MODES = ("eager", "stock", "ours")

Scenario = Callable[["Env"], dict[str, Any]]


def summarize(error: BaseException) -> str:
    """``"<ExceptionType>: <first line of the message>"`` (what two runs must agree on)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@dataclass
class Env:
    """What a scenario may ask of the run it is part of (see the module docstring)."""

    mode: str
    backend: str = "aot_eager"
    enable_kwargs: dict[str, Any] = field(default_factory=dict)

    def ca(self) -> contextlib.AbstractContextManager[Any]:
        if self.mode == "eager":
            return contextlib.nullcontext()
        if self.mode == "stock":
            return _compat.enable_compiled_autograd(_compat.stock_ca_compiler(self.backend))
        return subclass_ca.enable(backend=self.backend, **self.enable_kwargs)

    def compile(self, fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        if self.mode == "eager":
            return fn
        return torch.compile(fn, backend=self.backend, **kwargs)

    @staticmethod
    def attempt(fn: Callable[[], Any]) -> str:
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - the outcome *is* the exception
            return summarize(error)
        return "ok"


@dataclass
class Outcome:
    """What one run of a scenario produced."""

    mode: str
    values: dict[str, Any] | None
    error: BaseException | None
    captures: int

    @property
    def error_summary(self) -> str | None:
        return None if self.error is None else summarize(self.error)


@contextlib.contextmanager
def _fresh_state() -> Iterator[None]:
    subclass_ca.reset()
    counters.clear()
    torch.manual_seed(0)
    try:
        yield
    finally:
        subclass_ca.reset()


def run(scenario: Scenario, mode: str, *, backend: str = "aot_eager", **enable_kwargs: Any) -> Outcome:
    """One run of ``scenario`` in ``mode`` (one of :data:`MODES`) from fresh caches and counters."""
    assert mode in MODES, mode
    env = Env(mode=mode, backend=backend, enable_kwargs=enable_kwargs)
    with _fresh_state():
        values: dict[str, Any] | None = None
        error: BaseException | None = None
        try:
            values = scenario(env)
        except Exception as raised:  # noqa: BLE001 - compared between runs
            error = raised
        captures = counters["compiled_autograd"]["captures"]
    return Outcome(mode=mode, values=values, error=error, captures=captures)


def run_both(scenario: Scenario, *, backend: str = "aot_eager", **enable_kwargs: Any) -> tuple[Outcome, Outcome]:
    """``(stock, ours)``: the scenario under stock compiled autograd, then under ``subclass_ca.enable()``."""
    stock = run(scenario, "stock", backend=backend)
    ours = run(scenario, "ours", backend=backend, **enable_kwargs)
    return stock, ours


def _leaves(values: dict[str, Any]) -> tuple[list[Any], Any]:
    return pytree.tree_flatten(values)


def assert_same_values(expected: dict[str, Any], actual: dict[str, Any], *, exact: bool = True,
                       what: str = "") -> None:
    """Same keys and structure; tensors of the same type, shape and dtype, equal (bitwise when ``exact``)."""
    want, want_spec = _leaves(expected)
    got, got_spec = _leaves(actual)
    assert got_spec == want_spec, f"{what}: different structure\n{got_spec}\n!=\n{want_spec}"
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(expected)[0]]
    for path, w, g in zip(paths, want, got):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"{what}{path}: {type(g).__name__} where a tensor was expected"
            assert type(g) is type(w), f"{what}{path}: type {type(g).__name__} != {type(w).__name__}"
            tolerance = {"atol": 0, "rtol": 0} if exact else {}
            torch.testing.assert_close(g, w, **tolerance, msg=lambda m, p=path: f"{what}{p}: {m}")
        else:
            assert g == w, f"{what}{path}: {g!r} != {w!r}"


def values_equal(expected: dict[str, Any] | None, actual: dict[str, Any] | None) -> bool:
    """Bitwise equality of two scenario results (no assertion)."""
    if expected is None or actual is None:
        return expected is actual
    try:
        assert_same_values(expected, actual)
    except AssertionError:
        return False
    return True


def assert_same_outcome(stock: Outcome, ours: Outcome, *, ignore: tuple[str, ...] = ()) -> None:
    """The same exception (type and first line) or the same values, bitwise; ``ignore`` drops keys."""
    if ours.error is not None and stock.error is None:
        raise AssertionError(f"subclass_ca raised where stock did not: {ours.error_summary}") from ours.error
    assert ours.error_summary == stock.error_summary, (
        f"stock raised {stock.error_summary!r}, subclass_ca raised {ours.error_summary!r}"
    )
    if stock.error is None:
        assert_same_values(_drop(stock.values, ignore), _drop(ours.values, ignore), what="ours vs stock ")


def _drop(values: dict[str, Any] | None, keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in (values or {}).items() if k not in keys}
