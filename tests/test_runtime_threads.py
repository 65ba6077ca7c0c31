"""enable() across threads (Note [enable() blocks and threads]): settings never leak, errors are clear."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca.testing.subclasses import PairTensor, make_pair
from tests.helpers import KNOWN_ON_TORCH_BEFORE_2_13, GraphRecorder, assert_same_grad

TIMEOUT_S = 120


def _pair_problem(seed: int):
    torch.manual_seed(seed)
    dense, x = torch.randn(6, 6), torch.randn(4, 6)
    weight = torch.nn.Parameter(make_pair(dense.clone()))
    return weight, x, dense


def _run_in_thread(fn):
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            box["error"] = error

    thread = threading.Thread(target=target, name="thread-B")
    thread.start()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "thread B hung"
    return box


def test_second_thread_entering_gets_a_clear_error_and_first_keeps_its_settings():
    """Thread A holds enable(backend=recorder_a); thread B's enable(on_unsupported='eager') is refused."""
    weight, x, _ = _pair_problem(0)
    recorder_a, recorder_b = GraphRecorder(), GraphRecorder()
    step = torch.compile(lambda x: (x @ weight).tanh().sum(), backend="aot_eager")
    with subclass_ca.enable(recorder_a):
        box = _run_in_thread(lambda: subclass_ca.enable(recorder_b, on_unsupported="eager").__enter__())
        assert isinstance(box.get("error"), subclass_ca.SubclassCAError), box
        message = str(box["error"])
        assert "process-wide" in message and "thread-B" in message and "MainThread" in message
        step(x).backward()
    assert recorder_a.graphs and not recorder_b.graphs, "thread A's backward used other settings"
    assert isinstance(weight.grad, PairTensor)


def test_b_entering_after_a_and_exiting_first_leaves_a_with_its_settings():
    """Exit order across threads: B's attempt (refused) and its exit change nothing of A's block."""
    weight, x, _ = _pair_problem(1)
    recorder_a = GraphRecorder()
    step = torch.compile(lambda x: (x @ weight).tanh().sum(), backend="aot_eager")
    block_b = subclass_ca.enable(strict=True)

    def b_enters_and_exits():
        with contextlib.suppress(subclass_ca.SubclassCAError):  # refused: A's block is open in another thread
            block_b.__enter__()
        return block_b.__exit__(None, None, None)

    with subclass_ca.enable(recorder_a):
        before = _compat.torch_state_snapshot()
        box = _run_in_thread(b_enters_and_exits)
        assert box.get("result") is False  # B's exit found nothing of B's to close
        assert _compat.torch_state_snapshot() == before  # A's patches and compiler untouched
        step(x).backward()
    assert len(recorder_a.graphs) == 1


def test_same_thread_inner_block_with_other_settings_exits_first_outer_keeps_its_own():
    weight, x, _ = _pair_problem(2)
    recorder_outer, recorder_inner = GraphRecorder(), GraphRecorder()
    step = torch.compile(lambda x: (x @ weight).tanh().sum(), backend="aot_eager")
    with subclass_ca.enable(recorder_outer):
        with subclass_ca.enable(recorder_inner):
            step(x).backward()
        assert len(recorder_inner.graphs) == 1 and not recorder_outer.graphs
        step(x).backward()  # same graph shape: must not reuse the inner block's graph (other settings)
    assert len(recorder_outer.graphs) == 1
    assert len(recorder_inner.graphs) == 1


@pytest.mark.xfail(
    KNOWN_ON_TORCH_BEFORE_2_13,
    reason="torch 2.11/2.12: when the threads interleave so, a second thread's compiled call meets the first's FX "
    "trace ('symbolically trace a dynamo-optimized function'), not yet turned into our clear error; a race, so "
    "some runs pass (not strict)",
    strict=False,
)
def test_two_threads_training_concurrently_get_eager_grads_or_the_clear_error():
    """Each thread trains 4 SGD steps, entering enable() per step; a refused enter is retried later."""
    steps, lr = 4, 0.1
    problems = {name: _pair_problem(seed) for name, seed in (("A", 10), ("B", 11))}
    refusals = {"A": 0, "B": 0}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def train(name: str) -> None:
        weight, x, _ = problems[name]
        step = compiled[name]
        start.wait()
        done = 0
        while done < steps:
            loss = step(x)
            try:
                with subclass_ca.enable():
                    loss.backward()
            except subclass_ca.SubclassCAError as error:
                assert "process-wide" in str(error)
                refusals[name] += 1
                continue
            with torch.no_grad():
                weight -= lr * weight.grad
            weight.grad = None
            done += 1

    # Forwards are compiled before the threads start: on torch 2.15 compiling a forward in one thread
    # while another thread's block has compiled autograd on (process-wide) fails in torch itself
    # ("Trying to run compiled autograd within another compiled autograd"); docs/api.md says so.
    compiled = {}
    for name, (weight, x, _) in problems.items():
        compiled[name] = torch.compile(lambda x, weight=weight: (x @ weight).tanh().sum(), backend="aot_eager")
        compiled[name](x)

    def guarded(name):
        try:
            train(name)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(n,), name=f"trainer-{n}") for n in problems]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a training thread hung"
    assert not errors, errors
    for weight, x, dense in problems.values():
        eager = torch.nn.Parameter(make_pair(dense.clone()))
        for _ in range(steps):
            (x @ eager).tanh().sum().backward()
            with torch.no_grad():
                eager -= lr * eager.grad
            eager.grad = None
        assert_same_grad(eager.detach(), weight.detach(), exact=False)
