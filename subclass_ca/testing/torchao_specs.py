"""Ready-made specs for torchao's training subclasses: what ``python -m subclass_ca check`` certifies with torchao.

Each entry says how its subclass is made in training, which scenarios apply to it, and why
the others do not (reported as skips with that reason, never hidden):

* ``nf4`` — ``NF4Tensor``, the frozen QLoRA base: a frozen weight with trainable neighbours.
* ``float8_training`` — ``convert_to_float8_training`` (tensorwise scaling): a module swap whose
  ``Float8TrainingTensor`` casts live inside the compiled forward.
* ``float8_weight`` — ``WeightWithDynamicFloat8CastTensor``, the parameter type of float8
  training with float8 all-gather (FSDP2), as a parameter and through the module swap.
* ``int8_mixed_precision``, ``int8_quantized_training``, ``bitnet`` — ``quantize_`` with
  torchao's quantized-training configs: parameters of the subclass, trained by SGD.
* ``optim_state_8bit``, ``optim_state_4bit`` — ``AdamW8bit`` / ``AdamW4bit``, whose states are
  ``OptimState8bit`` / ``OptimState4bit``, over several optimizer steps.

torchao is imported only when :func:`torchao_specs` is called; a torchao without one of them
leaves it out with the reason (:func:`unavailable_torchao_specs`).  Every torchao the ``torchao``
extra allows (0.15 to 0.18) has all of them; an entry names each place its object has lived in
that range (NF4Tensor moved in 0.18: :data:`NF4_MODULES`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .scenarios import ScenarioSkip, scenario_names
from .suite import SubclassSpec

__all__ = ["ENTRIES", "TORCHAO_SPEC_NAMES", "TORCHAO_TYPE_NAMES", "TorchaoEntry", "torchao_specs", "unavailable_torchao_specs"]

_FROZEN = "{type} is a frozen QLoRA base (torchao gives it no gradient and implements only the ops of a linear)"
_MODULE_ONLY = "{type} is made by {maker} inside the layers it converts: it is certified through module_swap"
_OPTIMIZER_ONLY = "{type} is an optimizer state: it never meets autograd, and is certified through optimizer_state"
_TANGENT_GUESS = ("torch.compile alone (no compiled autograd) fails the same way: a {type} "
                  "gradient reaches an AOT backward that guessed a plain tangent, and torchao 0.18 does not implement "
                  "__coerce_same_metadata_as_tangent__ for it")
_LINEAR_ONLY = "{type} implements F.linear, not the matmuls and elementwise ops of this scenario: certified through module_swap"


NF4_MODULES: tuple[str, ...] = (
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor",  # torchao 0.18
    "torchao.dtypes.nf4tensor",  # torchao 0.15-0.17
)
"""Where each supported torchao defines NF4Tensor and ``to_nf4``, newest first (the built-in handler's table too)."""


def _nf4(dense: torch.Tensor) -> torch.Tensor:
    import importlib

    for module_name in NF4_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        nf4: torch.Tensor = module.to_nf4(dense, block_size=min(64, dense.numel()), scaler_block_size=1)
        return nf4
    raise ImportError(f"this torchao has NF4Tensor in none of {', '.join(NF4_MODULES)}")


def _not_a_tensor_factory(type_name: str, maker: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def make(dense: torch.Tensor) -> torch.Tensor:
        raise ScenarioSkip(_MODULE_ONLY.format(type=type_name, maker=maker))

    return make


def _quantized(config: Callable[[], Any]) -> Callable[[torch.nn.Module], torch.nn.Module]:
    def convert(model: torch.nn.Module) -> torch.nn.Module:
        from torchao.quantization import quantize_

        quantize_(model, config())
        return model

    return convert


def _float8(model: torch.nn.Module, *, all_gather: bool = False) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted: torch.nn.Module = convert_to_float8_training(
        model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather))
    return converted


def _float8_weight(dense: torch.Tensor) -> torch.Tensor:
    from torchao.float8.float8_linear import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weight: torch.Tensor = WeightWithDynamicFloat8CastTensor(dense, LinearMMConfig(), torch.float8_e4m3fn)
    return weight


def _optimizer(name: str) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    def make(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torchao.optim

        optimizer: torch.optim.Optimizer = getattr(torchao.optim, name)(parameters, lr=1e-2)
        return optimizer

    return make


def _only(applicable: Iterable[str], reason: str) -> dict[str, str]:
    keep = set(applicable)
    return {name: reason for name in scenario_names() if name not in keep}


def _int8_mixed() -> Any:
    from torchao.prototype.quantized_training import int8_mixed_precision_training

    return int8_mixed_precision_training()


def _int8_quantized() -> Any:
    from torchao.prototype.quantized_training import int8_weight_only_quantized_training

    return int8_weight_only_quantized_training()


def _bitnet() -> Any:
    from torchao.prototype.quantized_training import bitnet_training

    return bitnet_training()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchaoEntry:
    """One torchao training subclass ``check`` certifies: its name in the table, the type it makes, and how."""

    name: str
    """The row name (``--subclass NAME``)."""
    type_name: str
    """The class torchao makes (its handler, where one is registered, covers it)."""
    needs: tuple[str, ...]
    """The torchao object the entry needs, as ``module:attribute``: every place it has lived in the supported
    releases, any one of which will do."""
    build: Callable[[str], SubclassSpec]
    """type name -> the spec (called only when ``needs`` imports)."""


def _frozen_base(type_name: str) -> SubclassSpec:
    return SubclassSpec(make_tensor=_nf4, not_applicable=_only(["frozen_weight"], _FROZEN.format(type=type_name)))


def _module_made(maker: str, convert: Callable[[torch.nn.Module], torch.nn.Module],
                 reason: str = _MODULE_ONLY) -> Callable[[str], SubclassSpec]:
    """A subclass torchao makes inside the layers ``convert`` swaps in: certified through module_swap alone."""
    def build(type_name: str) -> SubclassSpec:
        return SubclassSpec(make_tensor=_not_a_tensor_factory(type_name, maker), make_module=convert,
                            not_applicable=_only(["module_swap"], reason.format(type=type_name, maker=maker)))
    return build


def _optimizer_state(optimizer: str) -> Callable[[str], SubclassSpec]:
    def build(type_name: str) -> SubclassSpec:
        return SubclassSpec(make_tensor=_not_a_tensor_factory(type_name, optimizer), make_optimizer=_optimizer(optimizer),
                            not_applicable=_only(["optimizer_state"], _OPTIMIZER_ONLY.format(type=type_name)))
    return build


def _float8_weight_spec(type_name: str) -> SubclassSpec:
    return SubclassSpec(
        make_tensor=_float8_weight, make_module=functools.partial(_float8, all_gather=True),
        known_failures=dict.fromkeys(
            ["gradient_type", "autograd_function", "hook", "hook_intermediate", "dynamic_batch", "warmup_recompiles"],
            _TANGENT_GUESS.format(type=type_name)),
        not_applicable={"optimizer_state": f"{type_name} is a parameter, not an optimizer state",
                        "metadata_change": "its flatten metadata (the float8 config) is fixed per model"})


_TRAINING = "torchao.prototype.quantized_training"
ENTRIES: tuple[TorchaoEntry, ...] = (
    TorchaoEntry(name="nf4", type_name="NF4Tensor", needs=tuple(f"{module}:NF4Tensor" for module in NF4_MODULES),
                 build=_frozen_base),
    TorchaoEntry(name="float8_training", type_name="Float8TrainingTensor", needs=("torchao.float8:convert_to_float8_training",),
                 build=_module_made("Float8Linear", _float8)),
    TorchaoEntry(name="float8_weight", type_name="WeightWithDynamicFloat8CastTensor",
                 needs=("torchao.float8.fsdp_utils:WeightWithDynamicFloat8CastTensor",), build=_float8_weight_spec),
    TorchaoEntry(name="int8_mixed_precision", type_name="Int8MixedPrecisionTrainingLinearWeight",
                 needs=(f"{_TRAINING}:Int8MixedPrecisionTrainingLinearWeight",),
                 build=_module_made("quantize_", _quantized(_int8_mixed), _LINEAR_ONLY)),
    TorchaoEntry(name="int8_quantized_training", type_name="Int8QuantizedTrainingLinearWeight",
                 needs=(f"{_TRAINING}:Int8QuantizedTrainingLinearWeight",),
                 build=_module_made("quantize_", _quantized(_int8_quantized), _LINEAR_ONLY)),
    TorchaoEntry(name="bitnet", type_name="BitNetTrainingLinearWeight", needs=(f"{_TRAINING}:BitNetTrainingLinearWeight",),
                 build=_module_made("quantize_", _quantized(_bitnet), _LINEAR_ONLY)),
    TorchaoEntry(name="optim_state_8bit", type_name="OptimState8bit", needs=("torchao.optim:AdamW8bit",),
                 build=_optimizer_state("AdamW8bit")),
    TorchaoEntry(name="optim_state_4bit", type_name="OptimState4bit", needs=("torchao.optim:AdamW4bit",),
                 build=_optimizer_state("AdamW4bit")),
)
"""The one table of torchao's training subclasses: each entry names its type once."""

_SPECS: dict[str, TorchaoEntry] = {entry.name: entry for entry in ENTRIES}
TORCHAO_TYPE_NAMES: dict[str, str] = {entry.name: entry.type_name for entry in ENTRIES}
"""Row name -> the class it certifies (``check`` counts a registered handler of that class as covered)."""
TORCHAO_SPEC_NAMES: tuple[str, ...] = tuple(_SPECS)


def _missing(requirement: str | tuple[str, ...]) -> str | None:
    """Why ``module:attribute`` (or none of a tuple of them) cannot be imported from this torchao (None: it can)."""
    import importlib

    if isinstance(requirement, tuple):
        problems = []
        for place in requirement:
            problem = _missing(place)
            if problem is None:
                return None
            problems.append(problem)
        return "; ".join(problems)
    module_name, _, attribute = requirement.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure means the entry cannot run
        return f"{module_name} cannot be imported ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    if not hasattr(module, attribute):
        return f"this torchao has no {module_name}.{attribute}"
    return None


def _torchao_version() -> str | None:
    try:
        import torchao
    except Exception:  # noqa: BLE001 - not installed, or broken against this torch
        return None
    return str(getattr(torchao, "__version__", "unknown"))


def unavailable_torchao_specs() -> dict[str, str]:
    """name -> why that torchao entry is left out here (torchao missing, or this torchao lacks it)."""
    version = _torchao_version()
    if version is None:
        return {name: "torchao is not installed (pip install 'subclass_ca[torchao]')" for name in _SPECS}
    reasons = {}
    for name, entry in _SPECS.items():
        problem = _missing(entry.needs)
        if problem is not None:
            reasons[name] = f"torchao {version}: {problem}"
    return reasons


def torchao_specs() -> dict[str, SubclassSpec]:
    """The specs of every torchao training subclass this torchao provides (empty without torchao)."""
    unavailable = unavailable_torchao_specs()
    return {name: entry.build(entry.type_name) for name, entry in _SPECS.items() if name not in unavailable}
