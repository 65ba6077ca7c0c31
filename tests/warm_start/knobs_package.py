"""A small subclass package in two versions, for the never-stale tests (Note [Keys by behaviour]).

``write_package(folder, scale, version)`` writes ``knobs`` (and its ``knobs-<version>.dist-info``)
into ``folder``.  Nine wrapper subclasses (``TYPES``), each reaching ``scale`` through one
indirection that a name-based key cannot see: another module's constant, another module's
function, a class attribute, a staticmethod, an Enum member's value, an object whose ``repr``
hides its state, a closure over a mutable object, a helper of ``__torch_dispatch__``, and a
function of the package whose *installed version* changes.  Every type but the dispatch one
applies ``scale`` to its ``a`` part in ``__tensor_unflatten__`` (what compiled code, and a
compiled rebuild, call; eager autograd never does): with ``scale=2.0`` compiled gradients are
wrong (the "bug"), with ``scale=1.0`` they are eager's (the "fix").  The dispatch type applies
``scale`` after every op, in eager too: there a stale graph disagrees with run 2's eager.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

TYPES = ("ConstPair", "FuncPair", "ClassAttrPair", "StaticPair", "EnumPair", "HiddenPair", "ClosurePair",
         "UpgradePair", "DispatchPair")

_FILES = {
    "consts.py": "K = {scale}\n",
    "funcs.py": "def scale(a):\n    return a * {scale}\n",
    "modes.py": "import enum\n\n\nclass Mode(enum.Enum):\n    SCALE = {scale}\n",
    "hidden.py": textwrap.dedent('''\
        class Hidden:
            def __init__(self, k):
                self._k = k

            def __repr__(self):
                return "Hidden()"


        HIDDEN = Hidden({scale})
        '''),
    "closures.py": textwrap.dedent('''\
        _state = {{"k": {scale}}}


        def _make(state):
            def scale(a):
                return a * state["k"]
            return scale


        scale = _make(_state)
        '''),
    "upgrade.py": "def scale(a):\n    return a * {scale}\n",
    "dispatch.py": "def post(t):\n    return t * {scale}\n",
    "__init__.py": "__version__ = {version!r}\n",
    "types.py": textwrap.dedent('''\
        import torch
        import torch.utils._pytree as pytree

        from . import closures, consts, dispatch, funcs, hidden, modes, upgrade


        class KnobPair(torch.Tensor):
            @staticmethod
            def __new__(cls, a, b, outer_size=None, outer_stride=None):
                size = a.size() if outer_size is None else outer_size
                stride = a.stride() if outer_stride is None else outer_stride
                return torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=a.dtype, device=a.device)

            def __init__(self, a, b, outer_size=None, outer_stride=None):
                self.a = a
                self.b = b

            def __repr__(self):
                return f"{{type(self).__name__}}({{self.a!r}}, {{self.b!r}})"

            def __tensor_flatten__(self):
                return ["a", "b"], None

            @classmethod
            def _scale(cls, a):
                return a

            @classmethod
            def _post(cls, t):
                return t

            @classmethod
            def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
                return cls(cls._scale(inner["a"]), inner["b"], outer_size, outer_stride)

            @classmethod
            def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
                kwargs = kwargs or {{}}
                out_a = func(*pytree.tree_map_only(cls, lambda t: t.a, args), **pytree.tree_map_only(cls, lambda t: t.a, kwargs))
                out_b = func(*pytree.tree_map_only(cls, lambda t: t.b, args), **pytree.tree_map_only(cls, lambda t: t.b, kwargs))
                if func._schema.is_mutable:
                    return args[0]
                flat_a, spec = pytree.tree_flatten(out_a)
                flat_b = pytree.tree_leaves(out_b)
                wrapped = [cls(cls._post(x), y) if isinstance(x, torch.Tensor) else x for x, y in zip(flat_a, flat_b)]
                return pytree.tree_unflatten(wrapped, spec)


        class ConstPair(KnobPair):
            @classmethod
            def _scale(cls, a):
                return a * consts.K


        class FuncPair(KnobPair):
            @classmethod
            def _scale(cls, a):
                return funcs.scale(a)


        class ClassAttrPair(KnobPair):
            K = {scale}

            @classmethod
            def _scale(cls, a):
                return a * cls.K


        class StaticPair(KnobPair):
            @staticmethod
            def _times(a):
                return a * {scale}

            @classmethod
            def _scale(cls, a):
                return cls._times(a)


        class EnumPair(KnobPair):
            @classmethod
            def _scale(cls, a):
                return a * modes.Mode.SCALE.value


        class HiddenPair(KnobPair):
            @classmethod
            def _scale(cls, a):
                return a * hidden.HIDDEN._k


        class ClosurePair(KnobPair):
            @classmethod
            def _scale(cls, a):
                return closures.scale(a)


        class UpgradePair(KnobPair):
            @classmethod
            def _scale(cls, a):
                return upgrade.scale(a)


        class DispatchPair(KnobPair):
            @classmethod
            def _post(cls, t):
                return dispatch.post(t)
        '''),
}


def write_package(folder: Path, *, scale: float, version: str) -> Path:
    """Write ``knobs`` version ``version`` (every knob ``scale``) into ``folder``; returns ``folder``."""
    package = folder / "knobs"
    package.mkdir(parents=True, exist_ok=True)
    for name, template in _FILES.items():
        (package / name).write_text(template.format(scale=scale, version=version))
    for old in folder.glob("knobs-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = folder / f"knobs-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: knobs\nVersion: {version}\n")
    (info / "top_level.txt").write_text("knobs\n")
    return folder
