"""Reading torch's error text (``_compat.messages``): both Dynamo formats, and the refusals we translate."""

from __future__ import annotations

import pytest

from subclass_ca import _compat


class _Error(Exception):
    pass


@pytest.mark.parametrize(
    "text",
    [
        # torch 2.13 on
        "Observed exception\n  raised exception HookOnSubclassError('a hook returned None (\"bad\") for Pair')",
        # torch 2.11 / 2.12: Dynamo's variable trackers
        "Observed exception\n  raised exception HookOnSubclassError((ConstantVariable(str: 'a hook returned None (\"bad\") for Pair'),))",
        'Observed exception\n  raised exception HookOnSubclassError((ConstantVariable(str: "a hook returned None (\\"bad\\") for Pair"),))',
    ],
)
def test_raised_exception_reads_both_dynamo_formats(text):
    assert _compat.raised_exception(_Error(text)) == ("HookOnSubclassError", ('a hook returned None ("bad") for Pair',))


def test_raised_exception_reads_several_constant_arguments():
    text = "raised exception ValueError((ConstantVariable(str: 'x'), ConstantVariable(int: -3), ConstantVariable(NoneType: None)))"
    assert _compat.raised_exception(_Error(text)) == ("ValueError", ("x", -3, None))


@pytest.mark.parametrize(
    "text",
    [
        "no exception here",
        "raised exception Foo(TensorVariable())",
        "raised exception Foo((ListVariable(length=2),))",
        "raised exception Foo((ConstantVariable(str: 'unterminated),))",
    ],
)
def test_raised_exception_gives_none_for_what_is_not_a_literal(text):
    assert _compat.raised_exception(_Error(text)) is None


def test_read_refusal_splits_the_user_code():
    text = (
        "Unsupported: call_function UserDefinedObjectVariable\n"
        "  Explanation: Dynamo does not know how to trace it. Try something.\n"
        "from user code:\n"
        '   File "/home/me/train.py", line 12, in my_hook\n'
        "    optimizer.step()  hook_type = 'post_acc_grad_hook'\n"
    )
    refusal = _compat.read_refusal(_Error(text))
    assert refusal.frames == (("/home/me/train.py", "12", "my_hook"),)
    assert refusal.explanation == "Dynamo does not know how to trace it. Try something."
    assert refusal.hook_type == "post_acc_grad_hook"
    assert refusal.raised is None and refusal.kind.startswith("Unsupported")


def test_known_torch_refusals():
    assert _compat.is_nested_jagged_refusal(NotImplementedError("NestedTensor support not implemented for x"))
    assert not _compat.is_nested_jagged_refusal(RuntimeError("NestedTensor support not implemented"))
    refused = NotImplementedError("Found tensor of type <class 'm.Q'>, which is not supported by FakeTensorMode")
    assert _compat.fake_lift_refused_type(refused) == "<class 'm.Q'>"
    assert _compat.fake_lift_refused_type(NotImplementedError("other")) is None


def test_aliased_subclass_mutation_is_found_through_the_backend_failure_chain():
    aot = RuntimeError(
        "        Encountered aliased inputs that are mutated in the graph, but at least one input/output\n"
        "        to the graph is a tensor subclass. This is not supported today."
    )
    wrapped = RuntimeError("backend='aot_eager' raised")
    wrapped.__cause__ = aot
    assert _compat.is_aliased_subclass_mutation(aot)
    assert _compat.is_aliased_subclass_mutation(wrapped)
    assert not _compat.is_aliased_subclass_mutation(RuntimeError("Encountered aliased inputs"))
    assert not _compat.is_aliased_subclass_mutation(None)
