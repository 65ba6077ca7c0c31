"""What subclass_ca's pytest fixtures do: ``ca_matches_eager`` and the checkers the fixtures return.

The plugin itself (options, markers, fixtures) is the top-level module ``_subclass_ca_pytestplugin``,
the ``pytest11`` entry point ``subclass_ca``: pytest loads it into every run of an environment
where subclass_ca is installed, and it imports neither torch nor subclass_ca (Note [A plugin that
costs nothing until used] there).  A fixture imports this module, and with it torch and
subclass_ca, only when a test requests it:

* ``ca_backend`` — the backend to certify on: ``--ca-backend`` (default ``aot_eager``).
* ``assert_ca_matches_eager`` — :func:`assert_ca_matches_eager_with` of ``ca_backend``: runs ``fn(*inputs)``
  + backward eagerly and with ``torch.compile(fn)`` + ``subclass_ca.enable()`` (:func:`ca_matches_eager`).
* ``ca_check_subclass`` — :func:`check_subclass_with` of ``ca_backend``.

With ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, load the plugin by its entry-point name: ``pytest -p subclass_ca``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ca_matches_eager", "assert_ca_matches_eager_with", "check_subclass_with"]


def ca_matches_eager(
    fn: Callable[..., Any],
    *inputs: Any,
    gradient: Any = None,
    backend: str = "aot_eager",
    atol: float | None = None,
    rtol: float | None = None,
) -> dict[str, Any]:
    """Run ``fn`` eagerly and under subclass_ca on ``inputs``; raise AssertionError on any difference.

    ``fn`` must return a tensor: a scalar loss, or any tensor when ``gradient`` is given
    (it is passed to ``backward``).  Tolerances default to bitwise on aot_eager.
    Returns the eager and CA results (``{"eager": ..., "ca": ...}``) for further checks.
    """
    import torch

    import subclass_ca

    from .suite import compare_values, snapshot

    if atol is None and rtol is None:
        atol, rtol = (0.0, 0.0) if backend == "aot_eager" else (None, None)

    # The inputs themselves are used (a copy would go through the subclass's own detach/clone,
    # which may differ from the original); their .grad is cleared per run and restored after.
    leaves = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad]
    saved_grads = [leaf.grad for leaf in leaves]

    def run(compiled: bool) -> dict[str, Any]:
        for leaf in leaves:
            leaf.grad = None
        subclass_ca.reset()
        try:
            call = torch.compile(fn, backend=backend) if compiled else fn
            out = call(*inputs)
            if compiled:
                with subclass_ca.enable(backend):
                    out.backward(gradient)
            else:
                out.backward(gradient)
        finally:
            subclass_ca.reset()
        grads = {
            f"inputs[{i}].grad": c.grad for i, c in enumerate(inputs) if isinstance(c, torch.Tensor) and c.requires_grad
        }
        taken: dict[str, Any] = snapshot({"out": out.detach(), **grads})
        return taken

    try:
        eager = run(compiled=False)
        ca = run(compiled=True)
    finally:
        for leaf, grad in zip(leaves, saved_grads):
            leaf.grad = grad
    problems, _, _ = compare_values(eager, ca, atol=atol, rtol=rtol)
    if problems:
        name = getattr(fn, "__qualname__", repr(fn))
        raise AssertionError(f"subclass_ca [{backend}] differs from eager for {name}:\n" + "\n".join(f"- {p}" for p in problems))
    return {"eager": eager, "ca": ca}


def assert_ca_matches_eager_with(ca_backend: str) -> Callable[..., dict[str, Any]]:
    """The ``assert_ca_matches_eager`` fixture's value: ``check(fn, *inputs, gradient=None, backend=None, atol=None,
    rtol=None)``, :func:`ca_matches_eager` on ``ca_backend`` unless ``backend`` is given."""

    def check(fn: Callable[..., Any], *inputs: Any, backend: str | None = None, **options: Any) -> dict[str, Any]:
        return ca_matches_eager(fn, *inputs, backend=backend or ca_backend, **options)

    return check


def check_subclass_with(ca_backend: str) -> Callable[..., Any]:
    """The ``ca_check_subclass`` fixture's value: :func:`subclass_ca.testing.check_subclass` with
    ``backends=(ca_backend,)`` unless ``backends`` is given."""
    from .suite import check_subclass as run_check

    def check(make_tensor: Any, **options: Any) -> Any:
        options.setdefault("backends", (ca_backend,))
        return run_check(make_tensor, **options)

    return check
