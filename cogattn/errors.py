"""The errors cogattn raises for what a user can cause after the arguments were accepted."""

from __future__ import annotations

__all__ = ["NotRecordedError", "StoreError"]


class NotRecordedError(KeyError):
    """A map that was not recorded was asked for: a kind, step, layer, head or query outside the recording.

    A `KeyError`, so ``except KeyError`` keeps working; its message says what was recorded instead."""

    def __str__(self) -> str:  # KeyError quotes its message; this one reads as a sentence
        return str(self.args[0]) if self.args else ""


class StoreError(RuntimeError):
    """Writing a run failed (disk full, unwritable folder) or would not fit; committed records stay readable."""
