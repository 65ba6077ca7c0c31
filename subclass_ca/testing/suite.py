"""``check_subclass``: certify a wrapper subclass under subclass_ca against eager.

Runs every scenario of :mod:`subclass_ca.testing.scenarios` on a user's factory, once
eagerly and once with ``torch.compile`` forward + ``subclass_ca.enable()`` backward
(see Note [How a scenario is run twice]), and compares the results: values (recursively
through ``__tensor_flatten__``; non-tensor inner attributes such as DTensor's
``device_mesh`` are skipped), types (eager grad type == CA grad type) and constant
flatten contexts (a stale graph would carry stale metadata).

Uses only subclass_ca's public API: CA compile counts come from the capture reports
(``subclass_ca.reports()``), one per compiled-autograd capture.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

import subclass_ca

from .scenarios import (
    SCENARIOS,
    ModuleSwap,
    OptimizerFactory,
    Scenario,
    ScenarioConfigError,
    ScenarioContext,
    ScenarioSkip,
    get_scenario,
    iter_scenarios,
)

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "check_subclass",
    "CheckReport",
    "ScenarioResult",
    "SubclassSpec",
    "SubclassCATestSuite",
    "compare_values",
    "snapshot",
    "run_scenario",
]

Factory = Callable[[torch.Tensor], torch.Tensor]
STATUSES = ("pass", "fail", "skip")


# --- snapshots and comparison ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SubclassSnapshot:
    type: type
    context: Any
    shape: tuple[int, ...]
    dtype: torch.dtype
    inner: dict[str, Any]


class _Flattenable(Protocol):
    def __tensor_flatten__(self) -> tuple[list[str], Any]: ...


def _is_wrapper_subclass(value: object) -> TypeIs[_Flattenable]:
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__")


def snapshot(value: Any) -> Any:
    """Freeze ``value`` for later comparison without calling the subclass's own ops.

    Plain tensors are detached and cloned; a wrapper subclass becomes its type, flatten
    context, outer shape/dtype and the snapshots of its inner tensors (recursively);
    non-tensor inner attributes are dropped.  Containers are walked.
    """
    if isinstance(value, torch.Tensor):
        if _is_wrapper_subclass(value):
            names, context = value.__tensor_flatten__()
            inner = {n: snapshot(getattr(value, n)) for n in names if isinstance(getattr(value, n), torch.Tensor)}
            return _SubclassSnapshot(type(value), context, tuple(value.shape), value.dtype, inner)
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            return _SubclassSnapshot(type(value), None, tuple(value.shape), value.dtype, {"": value.detach().clone()})
        with torch.no_grad():
            return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    return value


@dataclasses.dataclass(kw_only=True)
class _Comparison:
    problems: list[str] = dataclasses.field(default_factory=list)
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0


def _type_name(value: Any) -> str:
    if isinstance(value, _SubclassSnapshot):
        return value.type.__qualname__
    return "None" if value is None else type(value).__qualname__


def _contexts_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - contexts holding tensors compare by repr
        return repr(a) == repr(b)


def _compare(eager: Any, ca: Any, path: str, out: _Comparison, atol: float | None, rtol: float | None) -> None:
    if isinstance(eager, dict) and isinstance(ca, dict):
        for key in sorted(set(eager) | set(ca), key=str):
            if key not in eager or key not in ca:
                out.problems.append(f"{path}{key}: present only in the {'CA' if key in ca else 'eager'} run")
                continue
            _compare(eager[key], ca[key], f"{path}{key}", out, atol, rtol)
        return
    if isinstance(eager, _SubclassSnapshot) or isinstance(ca, _SubclassSnapshot):
        if not (isinstance(eager, _SubclassSnapshot) and isinstance(ca, _SubclassSnapshot)) or eager.type is not ca.type:
            out.problems.append(f"{path}: type {_type_name(ca)} under CA, {_type_name(eager)} in eager")
            return
        if eager.shape != ca.shape or eager.dtype != ca.dtype:
            out.problems.append(f"{path}: shape/dtype {ca.shape}/{ca.dtype} under CA, {eager.shape}/{eager.dtype} in eager")
        if not _contexts_equal(eager.context, ca.context):
            out.problems.append(
                f"{path}: flatten context {ca.context!r} under CA, {eager.context!r} in eager (stale metadata?)"
            )
        _compare(eager.inner, ca.inner, f"{path}." if path else "", out, atol, rtol)
        return
    if isinstance(eager, torch.Tensor) and isinstance(ca, torch.Tensor):
        _compare_tensors(eager, ca, path, out, atol, rtol)
        return
    if isinstance(eager, torch.Tensor) or isinstance(ca, torch.Tensor) or type(eager) is not type(ca):
        out.problems.append(f"{path}: type {_type_name(ca)} under CA, {_type_name(eager)} in eager")
        return
    if isinstance(eager, (list, tuple)):
        if len(eager) != len(ca):
            out.problems.append(f"{path}: length {len(ca)} under CA, {len(eager)} in eager")
            return
        for index, (e, c) in enumerate(zip(eager, ca)):
            _compare(e, c, f"{path}[{index}]", out, atol, rtol)
        return
    if not _contexts_equal(eager, ca):
        out.problems.append(f"{path}: {ca!r} under CA, {eager!r} in eager")


def _compare_tensors(
    eager: torch.Tensor, ca: torch.Tensor, path: str, out: _Comparison, atol: float | None, rtol: float | None
) -> None:
    path = path.rstrip(".") or "<value>"
    if eager.shape != ca.shape or eager.dtype != ca.dtype:
        out.problems.append(f"{path}: shape/dtype {tuple(ca.shape)}/{ca.dtype} under CA, {tuple(eager.shape)}/{eager.dtype} in eager")
        return
    if eager.numel():
        e64 = eager.detach().to("cpu", torch.float64)
        c64 = ca.detach().to("cpu", torch.float64)
        finite = torch.isfinite(e64) & torch.isfinite(c64)
        diff = (e64 - c64).abs().where(finite, torch.zeros_like(e64))
        abs_err = float(diff.max())
        rel_err = float((diff / e64.abs().clamp_min(torch.finfo(torch.float32).tiny)).max())
        out.max_abs_error = max(out.max_abs_error, abs_err)
        out.max_rel_error = max(out.max_rel_error, rel_err)
    try:
        if atol is None or rtol is None:
            torch.testing.assert_close(ca.cpu(), eager.cpu(), equal_nan=True)
        else:
            torch.testing.assert_close(ca.cpu(), eager.cpu(), atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError as error:
        first = " ".join(str(error).split("\n")[:3])
        out.problems.append(f"{path}: values differ ({first})")


def compare_values(eager: Any, ca: Any, *, atol: float | None = 0.0, rtol: float | None = 0.0) -> tuple[list[str], float, float]:
    """Compare two snapshots (or raw values); returns (problems, max abs error, max rel error).

    ``atol``/``rtol`` None means ``torch.testing.assert_close``'s dtype defaults.
    """
    comparison = _Comparison()
    _compare(snapshot(eager), snapshot(ca), "", comparison, atol, rtol)
    return comparison.problems, comparison.max_abs_error, comparison.max_rel_error


# --- one scenario run -----------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScenarioResult:
    """One cell of a :class:`CheckReport`: a scenario on one subclass, backend and device."""

    subclass: str
    scenario: str
    backend: str
    device: str
    status: str
    """``"pass"``, ``"fail"`` or ``"skip"``."""
    reason: str = ""
    """Why it failed or was skipped (every problem found, one per line)."""
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    ca_compiles: int | None = None
    """Compiled-autograd captures during the CA run (one capture report each)."""
    subclass_nodes: int | None = None
    """make_subclass nodes summed over those captures (``CaptureReport.total_subclass_nodes``)."""
    seconds: float = 0.0
    first_difference: str = ""
    """The first value that differs from eager (name, max difference, or a type/dtype mismatch); empty if none."""
    reproduce: str = ""
    """The command that runs this one cell again (set by ``python -m subclass_ca check``)."""
    stock_status: str | None = None
    """The same cell under stock compiled autograd (``check --compare-stock``): pass, fail or skip; None: not run."""
    stock_reason: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.subclass, self.scenario, self.backend, self.device)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("max_abs_error", "max_rel_error"):
            if data[name] is not None and not math.isfinite(data[name]):
                data[name] = str(data[name])
        return data


NOT_APPLICABLE = "does not apply: "
"""How a skip's reason starts when the spec says the scenario does not apply (``SubclassSpec.not_applicable``)."""


def _error_text(error: BaseException) -> str:
    message = str(error).strip().split("\n")
    head = "\n".join(message[:6])
    return f"{type(error).__name__}: {head}" if head else type(error).__name__


def _newest_capture_index() -> int:
    report = subclass_ca.last_report()
    return -1 if report is None else report.capture_index


def _run_program(scenario: Scenario, spec: SubclassSpec, device: torch.device, mode: str, backend: str,
                 backward_context: Callable[[str], Any] | None = None) -> Any:
    if mode == "eager":
        compile_fn: Callable[..., Any] = lambda fn: fn  # noqa: E731

        def backward(loss: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
            loss.backward(gradient)

    else:
        compile_fn = lambda fn: torch.compile(fn, backend=backend)  # noqa: E731

        def backward(loss: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
            with (backward_context or subclass_ca.enable)(backend):
                loss.backward(gradient)

    torch.manual_seed(0)  # both runs draw the same random numbers (stochastic rounding, dropout, optimizer noise)
    ctx = ScenarioContext(make=spec.make_tensor, make_variant=spec.make_variant, make_plain=spec.make_plain, device=device,
                          compile=compile_fn, backward=backward, mode=mode, make_module=spec.make_module,
                          make_optimizer=spec.make_optimizer)
    return snapshot(scenario.program(ctx))


def run_scenario(
    scenario: Scenario | str,
    spec: SubclassSpec | Factory,
    *,
    subclass: str,
    backend: str = "aot_eager",
    device: str = "cpu",
    backward_context: Callable[[str], Any] | None = None,
    capture_count: Callable[[], int] | None = None,
) -> ScenarioResult:
    """Run one scenario of ``spec`` (a :class:`SubclassSpec`, or a bare factory) eagerly and under subclass_ca;
    never raises for a scenario failure.

    The spec says everything about the subclass: its factories, tolerances, the scenarios that do not apply (a skip
    with the reason, not run) and its known failures (a failure there is a skip whose reason names the limitation
    and carries every problem found).  ``backward_context(backend)`` replaces ``subclass_ca.enable(backend)``
    around the compiled run's backward (e.g. stock compiled autograd, for a side-by-side table), and
    ``capture_count()`` counts its captures.
    """
    scenario = get_scenario(scenario) if isinstance(scenario, str) else scenario
    spec = SubclassSpec.coerce(spec, name="run_scenario(spec)")
    started = time.perf_counter()

    def done(status: str, reason: str = "", **extra: Any) -> ScenarioResult:
        return ScenarioResult(subclass=subclass, scenario=scenario.name, backend=backend, device=device, status=status,
                              reason=reason, seconds=time.perf_counter() - started, **extra)

    if scenario.name in spec.not_applicable:
        return done("skip", NOT_APPLICABLE + spec.not_applicable[scenario.name])
    if device.startswith("cuda") and not torch.cuda.is_available():
        return done("skip", "CUDA is not available")
    atol, rtol = spec.atol, spec.rtol
    if atol is None and rtol is None and backend == "aot_eager":
        atol = rtol = 0.0  # aot_eager runs the same aten ops as eager: bitwise
    elif (atol is None) != (rtol is None):
        atol, rtol = atol or 0.0, rtol or 0.0
    torch_device = torch.device(device)

    subclass_ca.reset()
    try:
        eager = _run_program(scenario, spec, torch_device, "eager", backend)
    except ScenarioSkip as skip:
        return done("skip", str(skip))
    except ScenarioConfigError as error:
        return done("fail", f"misconfigured: {error}")
    except Exception as error:  # noqa: BLE001
        return done("skip", f"the eager reference run raised {_error_text(error)} (the subclass does not support this "
                    "scenario outside subclass_ca)")
    finally:
        subclass_ca.reset()

    before = _newest_capture_index()
    captures_before = capture_count() if capture_count is not None else 0
    try:
        ca = _run_program(scenario, spec, torch_device, "ca", backend, backward_context)
        error_text = None
    except Exception as error:  # noqa: BLE001
        ca, error_text = None, _error_text(error)
    finally:
        new_reports = [r for r in subclass_ca.reports() if r.capture_index > before]
        captured = capture_count() - captures_before if capture_count is not None else len(new_reports)
        subclass_ca.reset()
    compiles = captured
    nodes = sum(r.total_subclass_nodes for r in new_reports)
    stats: dict[str, Any] = dict(ca_compiles=compiles, subclass_nodes=nodes)

    problems: list[str] = []
    abs_err = rel_err = None
    if error_text is not None:
        problems.append(f"the {'subclass_ca' if backward_context is None else 'compiled'} run raised {error_text}")
    else:
        comparison = _Comparison()
        _compare(eager, ca, "", comparison, atol, rtol)
        problems += comparison.problems
        if comparison.problems:
            stats["first_difference"] = comparison.problems[0]
        abs_err, rel_err = comparison.max_abs_error, comparison.max_rel_error
        if scenario.exact_captures is not None and compiles != scenario.exact_captures:
            problems.append(f"{compiles} compiled-autograd captures, expected exactly {scenario.exact_captures}")
        if scenario.min_captures is not None and compiles < scenario.min_captures:
            problems.append(
                f"{compiles} compiled-autograd capture(s), expected at least {scenario.min_captures} (a metadata change "
                "must recompile)"
            )
    if not problems:
        return done("pass", max_abs_error=abs_err, max_rel_error=rel_err, **stats)
    reason = "\n".join(problems)
    known_failure = spec.known_failures.get(scenario.name) or scenario.known_failure
    if known_failure is not None:
        return done("skip", f"known failure ({known_failure}): {reason}", max_abs_error=abs_err,
                    max_rel_error=rel_err, **stats)
    return done("fail", reason, max_abs_error=abs_err, max_rel_error=rel_err, **stats)


# --- the report -----------------------------------------------------------------


@dataclasses.dataclass
class CheckReport:
    """Every :class:`ScenarioResult` of a check, in run order."""

    results: list[ScenarioResult] = dataclasses.field(default_factory=list)

    def __iter__(self) -> Any:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def extend(self, other: CheckReport | Iterable[ScenarioResult]) -> CheckReport:
        self.results.extend(other)
        return self

    def with_status(self, status: str) -> list[ScenarioResult]:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        return [r for r in self.results if r.status == status]

    @property
    def failures(self) -> list[ScenarioResult]:
        return self.with_status("fail")

    @property
    def passed(self) -> list[ScenarioResult]:
        return self.with_status("pass")

    @property
    def skipped(self) -> list[ScenarioResult]:
        return self.with_status("skip")

    @property
    def ok(self) -> bool:
        return not self.failures

    def get(self, scenario: str, *, subclass: str | None = None, backend: str | None = None, device: str | None = None) -> ScenarioResult:
        """The one result matching the filters (ValueError if none or several)."""
        found = [
            r for r in self.results
            if r.scenario == scenario and subclass in (None, r.subclass) and backend in (None, r.backend)
            and device in (None, r.device)
        ]
        if len(found) != 1:
            raise ValueError(f"{len(found)} results match scenario={scenario!r} subclass={subclass!r} backend={backend!r} device={device!r}")
        return found[0]

    def failure_text(self) -> str:
        lines = [f"{len(self.failures)} subclass_ca check failure(s):"]
        for r in self.failures:
            lines.append(f"- {r.subclass} / {r.scenario} [{r.backend}, {r.device}]:")
            lines += [f"    {line}" for line in r.reason.splitlines()]
        return "\n".join(lines)

    def raise_for_failures(self) -> None:
        """Raise ``AssertionError`` listing every failure (subclass, scenario, backend, device, reason)."""
        if self.failures:
            raise AssertionError(self.failure_text())

    def summary(self) -> str:
        text = f"{len(self.passed)} passed, {len(self.failures)} failed, {len(self.skipped)} skipped"
        if any(r.stock_status is not None for r in self.results):
            text += (f"; stock compiled autograd wrong or refusing where subclass_ca passes: {len(self.beyond_stock)}, "
                     f"stock passing where subclass_ca does not: {len(self.behind_stock)}")
        return text

    @property
    def beyond_stock(self) -> list[ScenarioResult]:
        """Cells subclass_ca passes and stock compiled autograd fails (wrong values, or an error)."""
        return [r for r in self.results if r.status == "pass" and r.stock_status == "fail"]

    @property
    def behind_stock(self) -> list[ScenarioResult]:
        """Cells stock compiled autograd passes and subclass_ca does not (there must be none)."""
        return [r for r in self.results if r.stock_status == "pass" and r.status != "pass"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "subclass_ca_version": subclass_ca.__version__,
            "torch_version": str(torch.__version__),
            "summary": {s: len(self.with_status(s)) for s in STATUSES},
            "results": [r.to_dict() for r in self.results],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def table(self, *, unicode: bool = True) -> str:
        """Scenario rows × subclass columns: ✓ with the max abs error, ✗, or skip."""
        columns: list[tuple[str, str, str]] = []
        for r in self.results:
            col = (r.subclass, r.backend, r.device)
            if col not in columns:
                columns.append(col)
        rows = [name for name in SCENARIOS if any(r.scenario == name for r in self.results)]
        rows += [r.scenario for r in self.results if r.scenario not in rows]
        cells = {(r.scenario, (r.subclass, r.backend, r.device)): r for r in self.results}
        ok_mark, fail_mark = ("✓", "✗") if unicode else ("ok", "FAIL")
        multi = len({c[1:] for c in columns}) > 1

        def status_text(status: str | None) -> str:
            return ok_mark if status == "pass" else fail_mark if status == "fail" else "skip"

        def cell_text(result: ScenarioResult | None) -> str:
            if result is None:
                return ""
            if result.status == "skip" and result.reason.startswith(NOT_APPLICABLE):
                return "n/a"
            text = status_text(result.status)
            if result.status == "pass":
                text += f" {result.max_abs_error:.1e}" if result.max_abs_error else " 0"
            if result.stock_status is not None:  # check --compare-stock: ours | stock
                text += f" | stock {status_text(result.stock_status)}"
            return text

        headers = ["scenario"] + [f"{c[0]} [{c[1]},{c[2]}]" if multi else c[0] for c in columns]
        body = [[row] + [cell_text(cells.get((row, col))) for col in columns] for row in rows]
        widths = [max(len(line[i]) for line in [headers, *body]) for i in range(len(headers))]
        fmt = lambda line: "  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip()  # noqa: E731
        lines = [fmt(headers), fmt(["-" * w for w in widths])] + [fmt(line) for line in body]
        return "\n".join(lines)


# --- specs and the public entry point -------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubclassSpec:
    """How to certify one subclass: what ``SUBCLASS_CA_FACTORIES`` values may be, besides a bare factory."""

    make_tensor: Factory
    """dense float tensor (on the scenario's device) -> subclass instance."""
    make_variant: Factory | None = None
    """Like ``make_tensor`` but with different constant flatten metadata (for ``metadata_change``)."""
    make_plain: Factory | None = None
    """How the scenarios' plain neighbour tensors are wrapped (None: left dense); e.g. a
    Replicate DTensor factory for DTensor, whose ops refuse mixed plain operands."""
    atol: float | None = None
    """Absolute tolerance (None: bitwise on aot_eager, assert_close defaults elsewhere)."""
    rtol: float | None = None
    """Relative tolerance (see ``atol``)."""
    scenarios: Sequence[str] | None = None
    """Scenario names to run (None: the whole battery)."""
    known_failures: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """scenario name -> documented limitation: a failure there is reported as a skip naming it."""
    make_module: ModuleSwap | None = None
    """How a model's ``nn.Linear`` layers become the subclass's training modules (``module_swap``)."""
    make_optimizer: OptimizerFactory | None = None
    """parameters -> an optimizer whose states are the subclass (``optimizer_state``)."""
    not_applicable: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """scenario name -> why it does not apply to this subclass: not run, reported as a skip with the reason."""

    def __post_init__(self) -> None:
        if not callable(self.make_tensor):
            raise ValueError(f"SubclassSpec.make_tensor must be callable, got {self.make_tensor!r}")
        for name in self.not_applicable:
            get_scenario(name)
        for field_name in ("make_variant", "make_plain", "make_module", "make_optimizer"):
            value = getattr(self, field_name)
            if value is not None and not callable(value):
                raise ValueError(f"SubclassSpec.{field_name} must be callable or None, got {value!r}")
        for name in [*(self.scenarios or ()), *self.known_failures]:
            get_scenario(name)

    @classmethod
    def coerce(cls, value: Any, *, name: str = "factory") -> SubclassSpec:
        """A spec from a spec or a bare factory (ValueError naming ``name`` otherwise)."""
        if isinstance(value, SubclassSpec):
            return value
        if callable(value):
            return cls(make_tensor=value)
        raise ValueError(
            f"{name}: expected a factory (dense tensor -> subclass) or a subclass_ca.testing.SubclassSpec, got {value!r}"
        )


def _default_name(make_tensor: Factory) -> str:
    try:
        return type(make_tensor(torch.zeros(2, 2))).__qualname__
    except Exception:  # noqa: BLE001
        return getattr(make_tensor, "__name__", "subclass")


def _as_tuple(value: str | Sequence[str], what: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    if not items or not all(isinstance(v, str) and v for v in items):
        raise ValueError(f"check_subclass({what}=...): expected a non-empty sequence of names, got {value!r}")
    return items


def check_subclass(
    make_tensor: Factory | SubclassSpec,
    *,
    scenarios: Sequence[str] | str | None = None,
    backends: Sequence[str] | str = ("aot_eager",),
    devices: Sequence[str] | str = ("cpu",),
    atol: float | None = None,
    rtol: float | None = None,
    make_variant: Factory | None = None,
    make_plain: Factory | None = None,
    known_failures: Mapping[str, str] | None = None,
    name: str | None = None,
    progress: Callable[[ScenarioResult], None] | None = None,
) -> CheckReport:
    """Run the scenario battery on ``make_tensor`` (dense -> subclass), eager vs ``subclass_ca.enable()``.

    Returns a :class:`CheckReport` with one result per scenario × backend × device;
    call ``report.raise_for_failures()`` in a test.  ``make_variant`` builds tensors whose
    constant flatten metadata differs (needed by ``metadata_change``); ``make_plain`` wraps
    the scenarios' plain neighbour tensors (None: dense); ``known_failures`` maps scenario
    names to documented limitations (reported as skips carrying the error); ``atol``/``rtol``
    default to bitwise on aot_eager and ``assert_close``'s defaults on other backends;
    ``progress`` is called with each result as it completes.
    """
    spec = SubclassSpec.coerce(make_tensor, name="check_subclass(make_tensor)")
    overrides: dict[str, Any] = dict(make_variant=make_variant, make_plain=make_plain, atol=atol, rtol=rtol,
                                     known_failures=known_failures)
    spec = dataclasses.replace(spec, **{field: value for field, value in overrides.items() if value is not None})
    # (validated again: an unknown scenario name among known_failures raises here)
    chosen = list(iter_scenarios(scenarios if scenarios is not None else spec.scenarios))
    backends = _as_tuple(backends, "backends")
    devices = _as_tuple(devices, "devices")
    name = name or _default_name(spec.make_tensor)
    report = CheckReport()
    for backend in backends:
        for device in devices:
            for item in chosen:
                result = run_scenario(item, spec, subclass=name, backend=backend, device=device)
                report.results.append(result)
                if progress is not None:
                    progress(result)
    return report


# --- the base test class --------------------------------------------------------


class SubclassCATestSuite:
    """Base class for a pytest class that certifies one subclass (the torchao pattern).

    ::

        class TestMyTensor(subclass_ca.testing.SubclassCATestSuite):
            make_tensor = staticmethod(lambda dense: MyTensor(dense))

    expands into one test per scenario × backend × device, named
    ``test_<scenario>__<backend>__<device>``; a failure raises the report's
    ``AssertionError``, a skip calls ``pytest.skip`` with its reason.  Class attributes:
    ``make_tensor`` (required), ``make_variant``, ``make_plain``, ``known_failures``, ``scenarios``, ``backends``,
    ``devices``, ``atol``, ``rtol``.  Inductor tests carry ``@pytest.mark.inductor`` and
    CUDA tests ``@pytest.mark.cuda``.
    """

    make_tensor: Factory | None = None
    make_variant: Factory | None = None
    make_plain: Factory | None = None
    known_failures: Mapping[str, str] | None = None
    scenarios: Sequence[str] | None = None
    backends: Sequence[str] = ("aot_eager",)
    devices: Sequence[str] = ("cpu",)
    atol: float | None = None
    rtol: float | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("make_tensor") is None and cls.make_tensor is None:
            return  # an intermediate base without a factory: nothing to expand
        for item in iter_scenarios(cls.scenarios):
            for backend in _as_tuple(cls.backends, "backends"):
                for device in _as_tuple(cls.devices, "devices"):
                    test_name = f"test_{item.name}__{backend}__{device}"
                    if test_name not in cls.__dict__:
                        setattr(cls, test_name, _make_test(item.name, backend, device))

    def check(self, scenario: str, backend: str, device: str) -> ScenarioResult:
        """Run one cell for this suite's configuration."""
        factory = type(self).make_tensor  # class access unwraps staticmethod
        if factory is None:
            raise TypeError(
                f"{type(self).__name__}.check(): the suite has no make_tensor; set the class attribute "
                "`make_tensor = staticmethod(lambda dense: MyTensor(...))` (dense tensor -> your subclass)"
            )
        spec = SubclassSpec(make_tensor=factory, make_variant=type(self).make_variant, make_plain=type(self).make_plain,
                            atol=self.atol, rtol=self.rtol, known_failures=dict(self.known_failures or {}))
        report = check_subclass(spec, scenarios=[scenario], backends=[backend], devices=[device], name=type(self).__name__)
        result = report.results[0]
        if result.status == "skip":
            import pytest

            pytest.skip(f"{scenario}: {result.reason}")
        report.raise_for_failures()
        return result


def _make_test(scenario: str, backend: str, device: str) -> Callable[[Any], None]:
    def test(self: SubclassCATestSuite) -> None:
        self.check(scenario, backend, device)

    test.__name__ = test.__qualname__ = f"test_{scenario}__{backend}__{device}"
    test.__doc__ = f"{SCENARIOS[scenario].description} [{backend}, {device}]"
    try:
        import pytest
    except ImportError:  # the suite is usable without pytest (unittest-style runners)
        return test
    if backend == "inductor":
        test = pytest.mark.inductor(test)
    if device.startswith("cuda"):
        test = pytest.mark.cuda(test)
    return test
