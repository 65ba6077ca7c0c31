"""One process of the never-stale tests: ``knobs`` types under some programs, in one warm-start form.

``python tests/warm_start/stale_worker.py '<json>'`` with ``package`` (the folder holding ``knobs``),
``types`` (a type's place in it sets the depth of its model), ``programs`` and ``cases`` (``[program,
type]`` pairs to run; every program with every type when absent).  The programs: "compiled" (a
compiled forward), "eager" (an eager forward), "step" (a ``torch.compile``-d train step calling
``loss.backward()`` with ``compiled_autograd=True``), "regional" (a stack of identical blocks each
compiled on its own, whose CA graph is cut into regional pieces, Note [Regional CA graphs]).  The
form is set by ``save`` (a path: ``save_cache(path)``; null: ``save_cache()`` into the folder, kept
traces included; absent: torch's cache folder alone) and ``load`` (a path: ``load_cache(path)``).
Prints one JSON line: per case the gradients under ``subclass_ca.enable(backend="inductor")`` and
eager's, computed in this process, and the process's cache counters (AOTAutogradCache hits, kept
traces replayed; per regional case its pieces, distinct compiles, cache hits and kept traces replayed).
"""

from __future__ import annotations

import json
import sys

import torch


def _inner(t: torch.Tensor) -> list[float]:
    if hasattr(t, "a"):
        return _inner(t.a) + _inner(t.b)
    return t.detach().double().flatten().tolist()


class _Block(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(h @ self.weight)


def _blocks(cls: type, w0: torch.Tensor, count: int, *, compiled: bool) -> torch.nn.Sequential:
    """``count`` identical blocks with ``cls`` weights, each compiled on its own (``compiled``), as regional compilation does."""
    stack = torch.nn.Sequential(*(_Block(cls(w0.clone(), w0 * 0.5)) for _ in range(count)))
    if compiled:
        for block in stack:
            block.compile(backend="inductor")
    return stack


def main(settings: dict) -> dict:
    sys.path.insert(0, settings["package"])
    import knobs.types

    import subclass_ca
    from subclass_ca import _compat
    from subclass_ca._warm_start import traced

    if settings.get("load"):
        subclass_ca.load_cache(settings["load"])
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # one code object (loss_of, step) per type: 9 compiles each, by design
    result: dict = {"types": {}}
    names = list(settings["types"])  # a type's place in it sets its model's depth, whichever cases run
    cases = settings.get("cases") or [(p, n) for p in settings["programs"] for n in names]
    for program, name in cases:
        cls = getattr(knobs.types, name)
        torch.manual_seed(0)
        w0, x = torch.randn(6, 6), torch.randn(3, 6)
        depth = 1 + names.index(name)  # an autograd graph per type: one CA graph each, all sizes static

        def loss_of(w, inputs):
            h = inputs @ w
            for _ in range(depth):  # noqa: B023  -- called within this iteration only
                h = h.tanh()
            return h.sum()

        eager = torch.nn.Parameter(cls(w0.clone(), w0 * 0.5))
        loss_of(eager, x).backward()
        w = torch.nn.Parameter(cls(w0.clone(), w0 * 0.5))
        if program == "compiled":
            forward = torch.compile(loss_of, backend="inductor")
            with subclass_ca.enable(backend="inductor"):
                forward(w, x).backward()
        elif program == "eager":
            with subclass_ca.enable(backend="inductor"):
                loss_of(w, x).backward()
        elif program == "regional":
            eager_blocks, blocks = _blocks(cls, w0, depth + 2, compiled=False), _blocks(cls, w0, depth + 2, compiled=True)
            eager_blocks(x).sum().backward()
            loss = blocks(x).sum()
            hits_before, replayed_before = _compat.cache_counters()["aot_hit"], traced.stats["replayed"]
            with subclass_ca.enable(backend="inductor"):
                loss.backward()
            report = subclass_ca.last_report()
            hits = _compat.cache_counters()["aot_hit"] - hits_before  # the backward's: its pieces' entries
            replayed = traced.stats["replayed"] - replayed_before  # its pieces' kept traces
            result.setdefault("regional", {})[name] = [report.regional_pieces, report.regional_compiles, hits, replayed]
            result["types"][f"{program} {name}"] = {
                "grad": [v for block in blocks for v in _inner(block.weight.grad)],
                "eager": [v for block in eager_blocks for v in _inner(block.weight.grad)],
            }
            continue
        else:
            def step(inputs):
                loss = loss_of(w, inputs)  # noqa: B023  -- compiled and run within this iteration
                loss.backward()
                return loss.detach()

            with torch._dynamo.config.patch(compiled_autograd=True), subclass_ca.enable(backend="inductor"):
                torch.compile(step, backend="inductor")(x)
        result["types"][f"{program} {name}"] = {"grad": _inner(w.grad), "eager": _inner(eager.grad)}
    if "save" in settings:  # a path: save_cache(path); null: save_cache() (the cache folder's kept traces)
        subclass_ca.save_cache(settings["save"])
    result["aot_hits"] = _compat.cache_counters()["aot_hit"]
    result["replayed"] = traced.stats["replayed"]
    result["recorded"] = traced.stats["recorded"]
    from subclass_ca._warm_start import fingerprint
    result["no_key"] = fingerprint.uncacheable_reasons()
    return result


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
