"""What subclass_ca reads out of torch's error text: the one place that parses torch's messages.

torch reports many refusals only as text (Dynamo's ``Unsupported``, compiled autograd's fakeification
failure, the nested-tensor graph walk).  Every regular expression over that text lives here, so a
torch release that rewords a message breaks in this module and its tests only
(``tests/compat/test_messages.py``), never silently in the runtime.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from typing import Any

from .dynamo import graph_break_type

__all__ = [
    "Refusal", "read_refusal", "raised_exception", "is_nested_jagged_refusal", "fake_lift_refused_type",
    "is_aliased_subclass_mutation",
]

_RAISED = re.compile(r"raised exception (.+)$", re.MULTILINE)
_RAISED_CALL = re.compile(r"raised exception (\w+)\((.*)\)\s*$", re.MULTILINE)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXPLANATION = re.compile(r"^\s*Explanation: (.+)$", re.MULTILINE)
_HOOK_TYPE = re.compile(r"hook_type = '(\w+)'")
_CONSTANT_VARIABLE = re.compile(r"ConstantVariable\(\w+: ")
_NESTED_JAGGED = "NestedTensor support not implemented"
_ALIASED_SUBCLASS_MUTATION = re.compile(r"aliased inputs that are mutated in the graph, but at least one input/output\s+to the graph is a tensor subclass")
_FAKE_LIFT = re.compile(r"Found tensor of type (?P<type><[^>]*>|\S+), which is not supported by FakeTensorMode")


@dataclass(frozen=True)
class Refusal:
    """Dynamo's refusal to trace a graph, as its text tells it."""

    kind: str
    """Dynamo's short name for it (``gb_type``, or the first line of the text)."""
    raised: str | None
    """For an exception the traced code raised: its description (``X('...')``)."""
    user_code: str
    """The text after "from user code:" (the traced frames and the line)."""
    frames: tuple[tuple[str, str, str], ...]
    """(file, line, function) of each frame of the user code."""
    explanation: str | None
    hook_type: str | None
    """The kind of hook the refused code belongs to, where Dynamo names one."""


def read_refusal(error: BaseException) -> Refusal:
    text = str(error)
    raised = _RAISED.search(text)
    user_code = text.split("from user code:", 1)[1] if "from user code:" in text else ""
    explanation = _EXPLANATION.search(text)
    hook_type = _HOOK_TYPE.search(user_code)
    return Refusal(
        kind=graph_break_type(error),
        raised=raised.group(1).strip() if raised else None,
        user_code=user_code,
        frames=tuple(_FRAME.findall(user_code)),
        explanation=explanation.group(1).strip() if explanation else None,
        hook_type=hook_type.group(1) if hook_type else None,
    )


def raised_exception(error: BaseException) -> tuple[str, tuple[Any, ...]] | None:
    """``(class name, constructor arguments)`` of an exception the traced code raised, else None.

    torch 2.13 on writes ``raised exception X('msg')``; up to torch 2.12 Dynamo writes the arguments
    as its variable trackers, ``raised exception X((ConstantVariable(str: 'msg'),))``.  Both read
    as ``("X", ("msg",))``; arguments that are not literals give None.
    """
    observed = _RAISED_CALL.search(str(error))
    if observed is None:
        return None
    name, arguments = observed.group(1), observed.group(2)
    try:
        if _CONSTANT_VARIABLE.search(arguments):
            values = ast.literal_eval(_unwrap_constant_variables(arguments))
            return name, tuple(values) if isinstance(values, tuple) else (values,)
        return name, ast.literal_eval(f"({arguments},)")
    except (ValueError, SyntaxError, tokenize.TokenError, IndexError):
        return None


def _unwrap_constant_variables(text: str) -> str:
    """``(ConstantVariable(str: 'a'), ConstantVariable(int: 3))`` -> ``('a', 3)``: each tracker by its literal."""
    out, position = [], 0
    for match in _CONSTANT_VARIABLE.finditer(text):
        if match.start() < position:
            continue
        out.append(text[position : match.start()])
        rest = text[match.end() :]
        tokens = tokenize.generate_tokens(io.StringIO(rest).readline)
        literal = next(tokens)
        if literal.type == tokenize.OP and literal.string == "-":  # a negative number
            number = next(tokens)
            value, end = "-" + number.string, number.end
        else:
            value, end = literal.string, literal.end
        closing = next(tokens)
        if closing.string != ")" or end[0] != 1 or closing.end[0] != 1:
            raise ValueError(f"not a constant tracker: {rest[:40]!r}")
        out.append(value)
        position = match.end() + closing.end[1]
    out.append(text[position:])
    return "".join(out)


def is_nested_jagged_refusal(error: BaseException | None) -> bool:
    """compiled autograd's C++ graph walk refusing a nested (jagged) tensor."""
    return isinstance(error, NotImplementedError) and _NESTED_JAGGED in str(error)


def fake_lift_refused_type(error: BaseException | None) -> str | None:
    """The type named by compiled autograd's "not supported by FakeTensorMode" refusal, else None."""
    if not isinstance(error, NotImplementedError):
        return None
    lifted = _FAKE_LIFT.search(str(error))
    return lifted["type"] if lifted else None


def is_aliased_subclass_mutation(error: BaseException | None) -> bool:
    """AOTAutograd refusing to compile an in-place update of an input that another input aliases, with a subclass
    among the graph's inputs or outputs (an optimizer step on a wrapper-subclass parameter whose view was saved)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _ALIASED_SUBCLASS_MUTATION.search(str(error)):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__
    return False
