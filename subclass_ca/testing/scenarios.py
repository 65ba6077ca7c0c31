"""The scenario battery: small training programs run once eagerly and once under subclass_ca.

Note [How a scenario is run twice]
----------------------------------
A scenario is a plain function ``program(ctx) -> dict[str, value]``.  It builds its data
from ``ctx.dense(...)`` (seeded, so both runs see identical numbers), wraps it with the
user's factory (``ctx.make`` / ``ctx.make_variant``), and runs its forward through
``ctx.compile(fn)`` and its backward through ``ctx.backward(loss, gradient)``.  The
*eager* context makes ``compile`` the identity and ``backward`` a plain ``backward()``;
the *CA* context uses ``torch.compile(fn, backend=backend)`` and
``with subclass_ca.enable(backend): loss.backward()``.  Whatever the program returns
(gradients, parameters after optimizer steps, outputs) is snapshotted immediately — a
subclass is recorded as (type, flatten context, shape, dtype, inner snapshots), never
cloned through its own ``__torch_dispatch__`` — and the two snapshots are compared
value by value, type by type and context by context (suite.py).

A scenario may raise :class:`ScenarioSkip` when it does not apply (e.g. a subclass with
no constant metadata cannot change it).  A scenario with ``known_failure`` set is one
whose CA failure is a documented limitation owned elsewhere: its failure is reported
as a skip carrying the error, never hidden.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["Scenario", "ScenarioContext", "ScenarioSkip", "ScenarioConfigError", "SCENARIOS", "scenario_names", "get_scenario"]


class ScenarioSkip(Exception):
    """Raised by a scenario program that does not apply to the subclass under test."""


class ScenarioConfigError(ValueError):
    """Raised by a scenario program whose configuration is wrong (reported as a failure)."""


Factory = Callable[[torch.Tensor], torch.Tensor]
ModuleSwap = Callable[[torch.nn.Module], torch.nn.Module]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass(kw_only=True)
class ScenarioContext:
    """What a scenario program sees: factories, device and the eager-or-CA execution hooks."""

    make: Factory
    """The user's factory: dense tensor -> subclass instance."""
    make_variant: Factory | None
    """A second factory whose tensors differ from ``make``'s only in constant metadata."""
    make_plain: Factory | None = None
    """How "plain" neighbours are made (None: left dense).  DTensor models need every
    operand to be a DTensor, so their spec passes a Replicate factory here."""
    device: torch.device
    compile: Callable[[Callable[..., Any]], Callable[..., Any]]
    """Eager: identity.  CA: ``torch.compile(fn, backend=backend)``."""
    backward: Callable[..., None]
    """``backward(loss, gradient=None)``; CA: inside ``subclass_ca.enable(backend)``."""
    mode: str
    """``"eager"`` or ``"ca"`` (programs must not branch on it; it is for messages)."""
    make_module: ModuleSwap | None = None
    """How a model's ``nn.Linear`` layers become the subclass's training modules (a module swap
    such as ``convert_to_float8_training``, or ``quantize_``); returns the model."""
    make_optimizer: OptimizerFactory | None = None
    """parameters -> an optimizer whose states are the subclass (e.g. torchao's ``AdamW8bit``)."""
    seed: int = 0

    def dense(self, *shape: int, offset: int = 0) -> torch.Tensor:
        """A seeded float32 tensor on the device: the same numbers in both runs."""
        generator = torch.Generator().manual_seed(self.seed * 1000 + offset)
        return torch.randn(*shape, generator=generator).to(self.device)

    def plain(self, dense: torch.Tensor) -> torch.Tensor:
        """A "plain" neighbour tensor (dense unless the spec says how to wrap neighbours)."""
        return dense if self.make_plain is None else self.make_plain(dense)

    def leaf(self, dense: torch.Tensor, *, variant: bool = False) -> torch.Tensor:
        """A subclass leaf that requires grad."""
        return self.subclass(dense, variant=variant).requires_grad_()

    def subclass(self, dense: torch.Tensor, *, variant: bool = False) -> torch.Tensor:
        factory = self.make
        if variant:
            if self.make_variant is None:
                raise ScenarioSkip("no make_variant factory given")
            factory = self.make_variant
        return factory(dense)


Program = Callable[[ScenarioContext], dict[str, Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    """One certification scenario."""

    name: str
    """Short identifier (test names, table columns, ``scenarios=`` filters)."""
    description: str
    """What the scenario exercises, in one line."""
    program: Program
    exact_captures: int | None = None
    """If set, the CA run must perform exactly this many compiled-autograd captures."""
    min_captures: int | None = None
    """If set, the CA run must perform at least this many captures (e.g. a recompile)."""
    known_failure: str | None = None
    """A documented limitation owned elsewhere: a CA failure becomes a skip naming it."""


_SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, description: str, **options: Any) -> Callable[[Program], Program]:
    def register(program: Program) -> Program:
        if name in _SCENARIOS:
            raise ValueError(f"scenario {name!r} is defined twice")
        _SCENARIOS[name] = Scenario(name=name, description=description, program=program, **options)
        return program

    return register


def _grads(**tensors: torch.Tensor) -> dict[str, Any]:
    return {f"{name}.grad": t.grad for name, t in tensors.items()}


# --- the battery (order = table order) ------------------------------------------


@scenario("param_grad", "a subclass parameter gets its gradient (plain loss)")
def _param_grad(ctx: ScenarioContext) -> dict[str, Any]:
    w = ctx.leaf(ctx.dense(4, 4))
    x = ctx.subclass(ctx.dense(3, 4, offset=1))

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sum()

    loss = ctx.compile(fn)(x, w)
    ctx.backward(loss)
    return {"loss": loss, **_grads(w=w)}


@scenario("frozen_weight", "frozen subclass weight with trainable plain neighbours (LoRA-like)")
def _frozen_weight(ctx: ScenarioContext) -> dict[str, Any]:
    base = ctx.subclass(ctx.dense(4, 4))
    lora_a = ctx.plain(ctx.dense(4, 2, offset=1) * 0.1).requires_grad_()
    lora_b = ctx.plain(ctx.dense(2, 4, offset=2) * 0.1).requires_grad_()
    x = ctx.plain(ctx.dense(3, 4, offset=3)).requires_grad_()

    def fn(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ base + (x @ a) @ b).sum()

    loss = ctx.compile(fn)(x, base, lora_a, lora_b)
    ctx.backward(loss)
    return {"loss": loss, "base.grad": base.grad, **_grads(lora_a=lora_a, lora_b=lora_b, x=x)}


@scenario("activation", "a subclass intermediate activation inside the compiled region (saved for backward)")
def _activation(ctx: ScenarioContext) -> dict[str, Any]:
    x = ctx.leaf(ctx.dense(3, 4))
    w = ctx.plain(ctx.dense(4, 4, offset=1)).requires_grad_()

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(x) * 0.5
        out = hidden @ w
        return (out * out).sum()

    loss = ctx.compile(fn)(x, w)
    ctx.backward(loss)
    return {"loss": loss, **_grads(x=x, w=w)}


@scenario("gradient_type", "the subclass as the gradient (tangent) type: out.backward(make_tensor(g))")
def _gradient_type(ctx: ScenarioContext) -> dict[str, Any]:
    w = ctx.leaf(ctx.dense(4, 4))
    x = ctx.leaf(ctx.dense(3, 4, offset=1))

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    out = ctx.compile(fn)(x, w)
    ctx.backward(out, ctx.subclass(ctx.dense(3, 4, offset=2)))
    return {"out": out, **_grads(w=w, x=x)}


class _ScaledTanh(torch.autograd.Function):
    """y = tanh(x) * 2 with a hand-written backward (an autograd.Function inside the region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y * 2.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        scaled: torch.Tensor = grad * (1.0 - y * y) * 2.0
        return scaled


@scenario("autograd_function", "a custom torch.autograd.Function inside the compiled region")
def _autograd_function(ctx: ScenarioContext) -> dict[str, Any]:
    w = ctx.leaf(ctx.dense(4, 4))
    x = ctx.leaf(ctx.dense(3, 4, offset=1))

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _ScaledTanh.apply(x @ w)
        return out

    out = ctx.compile(fn)(x, w)
    ctx.backward(out, ctx.subclass(ctx.dense(3, 4, offset=2)))
    return {"out": out, **_grads(w=w, x=x)}


@scenario("optimizer", "mixed plain + subclass parameters, torch.optim.SGD over 3 steps")
def _optimizer(ctx: ScenarioContext) -> dict[str, Any]:
    w = ctx.leaf(ctx.dense(4, 4))
    proj = ctx.plain(ctx.dense(4, 4, offset=1) * 0.5).requires_grad_()
    bias = ctx.plain(ctx.dense(4, offset=2)).requires_grad_()
    optimizer = torch.optim.SGD([w, proj, bias], lr=0.1, foreach=False)

    def fn(x: torch.Tensor, w: torch.Tensor, proj: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x @ w) @ proj + bias).sum()

    step = ctx.compile(fn)
    results: dict[str, Any] = {}
    for index in range(3):
        optimizer.zero_grad()
        loss = step(ctx.subclass(ctx.dense(3, 4, offset=10 + index)), w, proj, bias)
        ctx.backward(loss)
        optimizer.step()
        results[f"step{index}.loss"] = loss
    results.update({"w": w, "proj": proj, "bias": bias})
    return results


@scenario("hook", "a tensor hook registered on a subclass leaf parameter")
def _hook(ctx: ScenarioContext) -> dict[str, Any]:
    w = ctx.leaf(ctx.dense(4, 4))
    x = ctx.leaf(ctx.dense(3, 4, offset=1))
    w.register_hook(lambda grad: grad * 3.0)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    out = ctx.compile(fn)(x, w)
    ctx.backward(out, ctx.subclass(ctx.dense(3, 4, offset=2)))
    return {"out": out, **_grads(w=w, x=x)}


@scenario(
    "hook_intermediate",
    "a tensor hook on a subclass intermediate created inside the compiled region",
)
def _hook_intermediate(ctx: ScenarioContext) -> dict[str, Any]:
    w = ctx.leaf(ctx.dense(4, 4))
    x = ctx.leaf(ctx.dense(3, 4, offset=1))

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        hidden = x @ w
        hidden.register_hook(lambda grad: grad * 3.0)
        return hidden * 2.0

    out = ctx.compile(fn)(x, w)
    ctx.backward(out, ctx.subclass(ctx.dense(3, 4, offset=2)))
    return {"out": out, **_grads(w=w, x=x)}


@scenario("dynamic_batch", "the batch size changes between steps (3, 5, 2)")
def _dynamic_batch(ctx: ScenarioContext) -> dict[str, Any]:
    w = ctx.leaf(ctx.dense(4, 4))

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    step = ctx.compile(fn)
    results: dict[str, Any] = {}
    for batch in (3, 5, 2):
        x = ctx.leaf(ctx.dense(batch, 4, offset=batch))
        out = step(x, w)
        ctx.backward(out, ctx.subclass(ctx.dense(batch, 4, offset=100 + batch)))
        results.update({f"batch{batch}.out": out, f"batch{batch}.x.grad": x.grad, f"batch{batch}.w.grad": w.grad})
        w.grad = None
    return results


def _flatten_context(tensor: torch.Tensor) -> Any:
    flatten = getattr(tensor, "__tensor_flatten__", None)
    return flatten()[1] if flatten is not None else None


@scenario("metadata_change", "constant flatten metadata changes between steps (must recompile, never stale)", min_captures=2)
def _metadata_change(ctx: ScenarioContext) -> dict[str, Any]:
    probe = ctx.subclass(ctx.dense(3, 4))
    if ctx.make_variant is None:
        if _flatten_context(probe) is None:
            raise ScenarioSkip("the subclass has no constant metadata (its __tensor_flatten__ context is None)")
        raise ScenarioSkip(
            "the subclass has constant metadata but no make_variant factory was given to change it "
            "(pass make_variant= / set make_variant on the suite)"
        )
    variant_probe = ctx.subclass(ctx.dense(3, 4), variant=True)
    if type(variant_probe) is type(probe) and _equal_context(_flatten_context(probe), _flatten_context(variant_probe)):
        raise ScenarioConfigError(
            f"make_variant builds {type(probe).__qualname__} tensors with the same flatten context as make_tensor "
            f"({_flatten_context(probe)!r}); it must change the constant metadata"
        )

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    step = ctx.compile(fn)
    results: dict[str, Any] = {}
    for label, variant in (("base", False), ("variant", True), ("base_again", False)):
        w = ctx.leaf(ctx.dense(4, 4), variant=variant)
        x = ctx.leaf(ctx.dense(3, 4, offset=1), variant=variant)
        out = step(x, w)
        ctx.backward(out, ctx.subclass(ctx.dense(3, 4, offset=2), variant=variant))
        results.update({f"{label}.out": out, f"{label}.w.grad": w.grad, f"{label}.x.grad": x.grad})
    return results


def _equal_context(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - contexts holding tensors
        return repr(a) == repr(b)


@scenario("warmup_recompiles", "5 steps with the same shapes: exactly one compiled-autograd capture", exact_captures=1)
def _warmup_recompiles(ctx: ScenarioContext) -> dict[str, Any]:
    w = ctx.leaf(ctx.dense(4, 4))
    x = ctx.leaf(ctx.dense(3, 4, offset=1))

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    step = ctx.compile(fn)
    results: dict[str, Any] = {}
    for index in range(5):
        out = step(x, w)
        ctx.backward(out, ctx.subclass(ctx.dense(3, 4, offset=10 + index)))
        results.update({f"step{index}.w.grad": w.grad, f"step{index}.x.grad": x.grad})
        w.grad = x.grad = None
    return results


def _mlp(ctx: ScenarioContext, width: int) -> torch.nn.Module:
    """Two bias-free Linear layers (sizes multiples of 16, as float8 and the low-bit kernels need), seeded."""
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(2 * width, width, bias=False))
    with torch.no_grad():
        layers = [layer for layer in model if isinstance(layer, torch.nn.Linear)]
        for index, layer in enumerate(layers):
            layer.weight.copy_(ctx.dense(*layer.weight.shape, offset=20 + index) / layer.weight.shape[1] ** 0.5)
    return model.to(ctx.device)


def _train(ctx: ScenarioContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer, width: int) -> dict[str, Any]:
    step = ctx.compile(model)
    results: dict[str, Any] = {}
    for index in range(3):
        loss = step(ctx.dense(16, width, offset=30 + index)).square().mean()
        ctx.backward(loss)
        results[f"step{index}.loss"] = loss.detach()
        results.update({f"step{index}.{name}.grad": p.grad for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        results.update({f"step{index}.{name}": p.detach() for name, p in model.named_parameters()})
    return results


@scenario("module_swap", "a 2-layer MLP whose Linear layers the spec's make_module converts (module swap, quantize_), 3 SGD steps")
def _module_swap(ctx: ScenarioContext) -> dict[str, Any]:
    if ctx.make_module is None:
        raise ScenarioSkip("the spec has no make_module (a module swap or quantize_ of nn.Linear layers)")
    model = ctx.make_module(_mlp(ctx, 32))
    return _train(ctx, model, torch.optim.SGD(model.parameters(), lr=0.1), 32)


@scenario("optimizer_state", "a 2-layer MLP trained 3 steps by the spec's optimizer, whose states are the subclass")
def _optimizer_state(ctx: ScenarioContext) -> dict[str, Any]:
    if ctx.make_optimizer is None:
        raise ScenarioSkip("the spec has no make_optimizer (an optimizer whose states are the subclass)")
    model = _mlp(ctx, 64)  # 64 x 128 weights: low-bit optimizers keep states of 4096+ elements quantized
    optimizer = ctx.make_optimizer(model.parameters())
    results = _train(ctx, model, optimizer, 64)
    for index, state in enumerate(optimizer.state.values()):
        results.update({f"state{index}.{name}": value for name, value in state.items() if isinstance(value, torch.Tensor)})
    return results


SCENARIOS: dict[str, Scenario] = dict(_SCENARIOS)
"""Every scenario of the battery, by name, in table order."""


def scenario_names() -> list[str]:
    return list(SCENARIOS)


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; allowed values are {scenario_names()}") from None


def iter_scenarios(names: Any = None) -> Iterator[Scenario]:
    """The scenarios named by ``names`` (None: all), validated, in battery order."""
    if names is None:
        yield from SCENARIOS.values()
        return
    if isinstance(names, str):
        names = [names]
    wanted = [get_scenario(n if isinstance(n, str) else n.name) for n in names]
    yield from wanted
