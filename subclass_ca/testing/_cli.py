"""``python -m subclass_ca check``: certify registered and zoo subclasses from the shell.

How a user module exposes factories
-----------------------------------
``--module pkg.mod`` imports ``pkg.mod`` (which may register handlers as a side effect)
and reads its module-level ``SUBCLASS_CA_FACTORIES`` dict::

    SUBCLASS_CA_FACTORIES = {
        "my_tensor": lambda dense: MyTensor(dense),              # a bare factory, or
        "my_tagged": subclass_ca.testing.SubclassSpec(             # a spec with options
            make_tensor=make_a, make_variant=make_b, atol=1e-6, rtol=1e-5),
    }

A factory takes a dense float tensor (already on the scenario's device) and returns the
subclass instance.  Every subclass registered with ``subclass_ca.register_handler`` that
no factory covers is listed as skipped ("no factory").

Exit status: 0 all passed (skips allowed), 1 any failure, 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import traceback
from typing import Any

import torch

import subclass_ca

from .. import _compat
from .scenarios import scenario_names
from .specs import ZOO_SPECS, builtin_specs
from .suite import CheckReport, ScenarioResult, SubclassSpec, run_scenario
from .torchao_specs import TORCHAO_TYPE_NAMES, torchao_specs, unavailable_torchao_specs

__all__ = ["main", "FACTORIES_ATTRIBUTE"]

FACTORIES_ATTRIBUTE = "SUBCLASS_CA_FACTORIES"
_BUILTIN_TYPE_NAMES = {"two_tensor": "TwoTensor", "dtensor": "DTensor"}
_STOCK_NOTE = "stock compiled autograd (torch's own epilogue), the same backend and program"


class UsageError(Exception):
    """A command-line mistake: reported with exit status 2."""


def _split(values: list[str] | None) -> list[str]:
    items: list[str] = []
    for value in values or ():
        items += [v.strip() for v in value.split(",") if v.strip()]
    return items


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m subclass_ca check",
        description="Run the subclass_ca scenario battery (eager vs subclass_ca.enable()) on every registered "
        "subclass with a factory plus the reference zoo, and print a scenario x subclass table.",
        epilog=f"A --module exposes factories as a module-level {FACTORIES_ATTRIBUTE} = {{'name': factory}} dict "
        "(factory: dense tensor -> subclass, or a subclass_ca.testing.SubclassSpec). Exit status: 0 passed, "
        "1 a scenario failed, 2 usage error.",
    )
    parser.add_argument("--module", action="append", metavar="PKG.MOD",
                        help=f"import this module (registers handlers, exposes {FACTORIES_ATTRIBUTE}); repeatable")
    parser.add_argument("--subclass", action="append", metavar="NAME",
                        help="only these subclasses (comma-separated; see --list)")
    parser.add_argument("--scenario", action="append", metavar="NAME",
                        help=f"only these scenarios (comma-separated): {', '.join(scenario_names())}")
    parser.add_argument("--backend", action="append", metavar="NAME", help="comma-separated backends (default aot_eager)")
    parser.add_argument("--device", action="append", metavar="NAME", help="comma-separated devices (default cpu)")
    parser.add_argument("--json", metavar="FILE", help="also write the full report as JSON to FILE")
    parser.add_argument("--no-zoo", action="store_true", help="leave out the reference zoo")
    parser.add_argument("--no-builtin", action="store_true", help="leave out the built-in handlers' subclasses")
    parser.add_argument("--no-torchao", action="store_true",
                        help="leave out torchao's training subclasses (certified by default when torchao is installed)")
    parser.add_argument("--compare-stock", action="store_true",
                        help="run every cell under stock compiled autograd too: the table shows both, and the summary "
                        "where stock is wrong or refuses and subclass_ca is right (and any cell the other way round)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--list", action="store_true", help="list the subclasses and scenarios, run nothing")
    return parser


def _load_module_specs(module_name: str) -> dict[str, SubclassSpec]:
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's to fix
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        raise UsageError(f"--module {module_name}: cannot import it ({detail}). Is it on PYTHONPATH?") from None
    factories = getattr(module, FACTORIES_ATTRIBUTE, None)
    if factories is None:
        return {}
    if not isinstance(factories, dict):
        raise UsageError(f"--module {module_name}: {FACTORIES_ATTRIBUTE} must be a dict name -> factory, "
                         f"got {type(factories).__name__}")
    specs = {}
    for name, value in factories.items():
        try:
            specs[str(name)] = SubclassSpec.coerce(value, name=f"{module_name}.{FACTORIES_ATTRIBUTE}[{name!r}]")
        except ValueError as error:
            raise UsageError(str(error)) from None
    return specs


def _probe_type_name(spec: SubclassSpec) -> str | None:
    try:
        return type(spec.make_tensor(torch.zeros(2, 2))).__name__
    except Exception:  # noqa: BLE001 - a factory that needs another shape: unknown type
        return None


def _collect(args: argparse.Namespace) -> tuple[dict[str, SubclassSpec], list[str]]:
    specs: dict[str, SubclassSpec] = {}
    covered: set[str] = set()

    def add(name: str, spec: SubclassSpec, origin: str, type_name: str | None) -> None:
        if name in specs:
            raise UsageError(f"subclass name {name!r} from {origin} is already taken; rename it in {FACTORIES_ATTRIBUTE}")
        specs[name] = spec
        if type_name:
            covered.add(type_name)

    for module_name in _split(args.module):
        for name, spec in _load_module_specs(module_name).items():
            add(name, spec, f"--module {module_name}", _probe_type_name(spec))
    if not args.no_builtin:
        for name, spec in builtin_specs().items():
            add(name, spec, "the built-in handlers", _BUILTIN_TYPE_NAMES.get(name))
    if not args.no_torchao:
        for name, spec in torchao_specs().items():
            add(name, spec, "torchao's training subclasses", TORCHAO_TYPE_NAMES.get(name))
    if not args.no_zoo:
        for name, spec in ZOO_SPECS.items():
            add(name, spec, "the zoo", _probe_type_name(spec))
    uncovered = sorted(
        cls.__name__ for cls in subclass_ca.handlers()
        if cls.__name__ not in covered and (not args.no_builtin or cls.__module__.split(".")[0] != "torch")
    )
    return specs, uncovered


def _validate_names(kind: str, wanted: list[str], known: list[str]) -> None:
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise UsageError(f"unknown {kind} {', '.join(map(repr, unknown))}; choose from: {', '.join(known)}")


def _validate_backends(backends: list[str]) -> None:
    known = sorted(torch.compiler.list_backends(exclude_tags=()))
    _validate_names("backend", backends, known)


def _validate_devices(devices: list[str]) -> None:
    for device in devices:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise UsageError(f"unknown device {device!r}; use e.g. cpu, cuda or cuda:1") from None


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="subclass_ca check", unit="scenario", file=sys.stderr, leave=False)


def _can_print_unicode() -> bool:
    try:
        "✓✗".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _run(args: argparse.Namespace) -> int:
    specs, uncovered = _collect(args)
    scenarios = _split(args.scenario) or scenario_names()
    _validate_names("scenario", scenarios, scenario_names())
    backends = _split(args.backend) or ["aot_eager"]
    devices = _split(args.device) or ["cpu"]
    _validate_backends(backends)
    _validate_devices(devices)
    chosen = _split(args.subclass)
    if chosen:
        _validate_names("subclass", chosen, [*specs, *uncovered])
        specs = {name: spec for name, spec in specs.items() if name in chosen}
        uncovered = [name for name in uncovered if name in chosen]
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"--json {args.json}: its directory does not exist")
    if args.list:
        print("subclasses: " + ", ".join([*specs, *(f"{n} (no factory)" for n in uncovered)]))
        print("scenarios:  " + ", ".join(scenarios))
        return 0
    if not specs:
        detail = f" (registered without a factory: {', '.join(uncovered)})" if uncovered else ""
        raise UsageError(
            "nothing to check: no subclass with a factory left after --subclass/--no-zoo/--no-builtin/--no-torchao"
            + detail + "; expose SUBCLASS_CA_FACTORIES in a --module"
        )

    report = CheckReport()
    units = [(n, s, b, d, sc) for n, s in specs.items() for b in backends for d in devices
             for sc in scenarios if not s.scenarios or sc in s.scenarios]
    bar = _progress_bar(len(units), not args.no_progress)
    try:
        for name, spec, backend, device, scenario in units:
            if bar is not None:
                bar.set_postfix_str(f"{name}/{scenario}")
            report.results.append(_run_cell(args, name, spec, backend, device, scenario))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    for name in uncovered:
        for backend in backends:
            for device in devices:
                report.results += [
                    ScenarioResult(subclass=name, scenario=sc, backend=backend, device=device, status="skip",
                                   reason=f"registered subclass {name} has no factory: add it to "
                                   f"{FACTORIES_ATTRIBUTE} in the module you pass with --module")
                    for sc in scenarios
                ]

    print(report.table(unicode=_can_print_unicode()))
    print()
    for result in report.failures:
        print(f"FAILED {result.subclass} / {result.scenario} [{result.backend}, {result.device}]:")
        if result.first_difference:
            print(f"    first difference: {result.first_difference}")
        print("\n".join(f"    {line}" for line in result.reason.splitlines()))
        print(f"    reproduce: {result.reproduce}")
    if args.compare_stock:
        for title, compared in (("subclass_ca right where stock is wrong or refuses", report.beyond_stock),
                                ("stock passes where subclass_ca does not", report.behind_stock)):
            print(f"{title}: {len(compared)}" + "".join(
                f"\n    {r.subclass} / {r.scenario} [{r.backend}, {r.device}]: stock: {r.stock_reason.splitlines()[0] if r.stock_reason else r.status}"
                for r in compared))
    if not args.no_torchao and not chosen:
        for name, why in unavailable_torchao_specs().items():
            print(f"not certified: {name}: {why}")
    skip_reasons: dict[str, list[str]] = {}
    for result in report.skipped:
        skip_reasons.setdefault(result.reason.splitlines()[0] if result.reason else "", []).append(
            f"{result.subclass}/{result.scenario}")
    for reason, cells in skip_reasons.items():
        print(f"skipped {', '.join(cells)}: {reason}")
    print(f"subclass_ca check: {report.summary()}")
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as handle:
                handle.write(report.to_json(indent=2))
        except OSError as error:
            raise UsageError(f"--json {args.json}: cannot write it ({error})") from None
    return 0 if report.ok and not report.behind_stock else 1


def _stock_context(backend: str, **_: Any) -> Any:
    return _compat.enable_compiled_autograd(_compat.stock_ca_compiler(backend))


def _stock_captures() -> int:
    return int(_compat.ca_counters().get("captures", 0))


def _reproduce(args: argparse.Namespace, name: str, backend: str, device: str, scenario: str) -> str:
    modules = "".join(f" --module {m}" for m in _split(args.module))
    stock = " --compare-stock" if args.compare_stock else ""
    return (f"python -m subclass_ca check{modules} --subclass {name} --scenario {scenario} --backend {backend} "
            f"--device {device}{stock} --no-progress")


def _run_cell(args: argparse.Namespace, name: str, spec: SubclassSpec, backend: str, device: str, scenario: str) -> ScenarioResult:
    """One cell, under subclass_ca (and stock with --compare-stock); a scenario that does not apply is a skip with its reason."""
    reproduce = _reproduce(args, name, backend, device, scenario)
    result = dataclasses.replace(run_scenario(scenario, spec, subclass=name, backend=backend, device=device),
                                 reproduce=reproduce)
    if not args.compare_stock:
        return result
    if scenario in spec.not_applicable:
        return dataclasses.replace(result, stock_status="skip")
    # stock is judged as it is: the spec's known failures are subclass_ca's documented limits, not stock's
    stock = run_scenario(scenario, dataclasses.replace(spec, known_failures={}), subclass=name, backend=backend,
                         device=device, backward_context=_stock_context, capture_count=_stock_captures)
    return dataclasses.replace(result, stock_status=stock.status, stock_reason=stock.reason)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m subclass_ca check``; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        return _run(args)
    except UsageError as error:
        print(f"subclass_ca check: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
