"""The locals of a pipeline's running call, for a family whose pipeline keeps what a recording needs in them (the
window of a long video it makes in windows, each a denoising loop: ``ModelSpec.window``).

A transformer call runs inside the pipeline's ``__call__``, so its frame is on the stack; its locals are read, never
written. A family reads names a step's callback cannot rebind (the callbacks' ``for k in ...`` rebinds ``k``).
"""

from __future__ import annotations

import inspect
import sys

__all__ = ["call_locals", "running_pipelines", "window_reader"]


def call_locals(pipeline) -> dict | None:
    """The locals of ``pipeline``'s ``__call__`` running on the stack; `None` outside one (a bare transformer)."""
    code = getattr(inspect.unwrap(type(pipeline).__call__), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return None if frame is None else frame.f_locals


def running_pipelines(transformer) -> list:
    """The pipelines whose ``__call__`` on the stack runs ``transformer`` (their ``transformer`` or
    ``transformer_2``), innermost first; none where no pipeline's call runs it (a bare call, a loop of the user's)."""
    found, frame = [], sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "__call__" else None
        if owner is not None and any(
            getattr(owner, name, None) is transformer for name in ("transformer", "transformer_2")
        ):
            found.append(owner)
        frame = frame.f_back
    return found


def window_reader(index: str, count: str):
    """A ``ModelSpec.window`` reading ``(index, count)`` from the call's locals ``index`` and ``count`` (a list's
    length, where ``count`` names a list of windows); `None` where the call has neither (one window)."""

    def window(pipeline) -> tuple[int, int] | None:
        found = call_locals(pipeline) or {}
        at, of = found.get(index), found.get(count)
        of = len(of) if isinstance(of, list) else of
        return (at, of) if isinstance(at, int) and isinstance(of, int) else None

    window.__doc__ = f"``(index, count)`` of the window running in the pipeline's call: its ``{index}`` of ``{count}``."
    return window
