"""What the summary names along a run's axes, and what it names the runs, each bounded by what the run holds.

run.json is untrusted (:mod:`cogattn.view.data`), so one number in it must not make the summary large: the text
tokens are named only where the run holds a kind with a text axis (the word kinds, ``audio_to_text``) and the
audio bins' seconds only where it holds an audio kind, each for at most :data:`MAX_LABELS` of them (the page writes
an index beyond). A run's name is the name of its folder, which need not be text (a name of Latin-1 bytes from an
archive): :func:`run_names` gives each run a name that is valid text, unique in the folder, which the page sends
back as it got it.
"""

from __future__ import annotations

import dataclasses

from ..errors import StoreError
from ..exact.reducers.audio import AUDIO_KINDS

__all__ = ["MAX_LABELS", "TEXT_KINDS", "audio_seconds", "one_line", "run_names", "token_labels"]

MAX_LABELS = 4096  # text tokens, and audio bins, the summary names (no prompt of a video model is longer)
TEXT_KINDS = ("video_to_text", "text_to_video", "audio_to_text")  # the kinds with a text token axis


def token_labels(run, kept, key: str = "tokens") -> list[str]:
    """A label for each text token ``run``'s records hold (the longest text axis of its :data:`TEXT_KINDS`, none
    without one), at most :data:`MAX_LABELS`: ``kept``, the batch tool's token strings, where it is a list
    (``"negative_tokens"``: the negative prompt's, the unconditional item's text, each at its item's spans); else
    each token's index, named by its part where the run keeps the item's spans (HunyuanVideo 1.5's ``image``,
    ``glyph`` and ``prompt`` tokens, then ``pad``)."""
    layout = run.layout
    if layout is None:
        return []
    n = min(layout.prompt_len, _held(run, TEXT_KINDS, lambda shape: shape[2]), MAX_LABELS)
    if isinstance(kept, list) and kept:
        return [str(t) for t in kept[:n]]
    names = [f"token {i}" for i in range(n)]
    spans = run.text_spans
    if spans:
        roles = list(run.batch_roles or ())
        want = "uncond" if key == "negative_tokens" else "cond"
        slot = roles.index(want) if want in roles else 0
        names = [f"pad {i}" for i in range(n)]
        for part, (a, b) in spans[min(slot, len(spans) - 1)].items():
            a, b = min(a, n), min(b, n)  # the spans lie within the text: those of the tokens named
            names[a:b] = [f"{part} {i - a}" for i in range(a, b)]
    return names


def audio_seconds(run) -> list[list[float]] | None:
    """Each audio bin's ``[start, end)`` in seconds (LTX-2), for the audio panel's readout: the bins its audio records
    hold, at most :data:`MAX_LABELS` (`None` where it holds none)."""
    layout = run.layout
    held = _held(run, AUDIO_KINDS, lambda shape: max(shape[2:]))  # an audio axis is one of a record's map axes
    if layout is None or layout.audio is None or not held:
        return None
    axis = dataclasses.replace(layout.audio, tokens=min(layout.audio.tokens, held, MAX_LABELS))  # a bin's own seconds
    return [[round(float(t), 4) for t in span] for span in axis.seconds()]


def _held(run, kinds, size) -> int:
    """The largest ``size(shape)`` of ``run``'s records of ``kinds`` (0 where it holds none)."""
    return max((size(r.shape) for r in run.records() if r.kind in kinds and len(r.shape) > 2), default=0)


def run_names(names) -> list[str]:
    """A name for each of ``names`` (folder names, in order) that is valid text (a name that is not UTF-8 with its
    bytes written ``\\xe9``) and unique among them (a second one the same gets `` (2)``)."""
    out: list[str] = []
    taken: set[str] = set()
    for name in names:
        shown = name
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # bytes the file system did not decode (surrogate escapes): written as bytes
            try:
                shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            except UnicodeEncodeError:  # another lone surrogate (a name made in Python): its code written out
                shown = name.encode("utf-8", "backslashreplace").decode("utf-8")
        unique, k = shown, 1
        while unique in taken:
            k += 1
            unique = f"{shown} ({k})"
        out.append(unique)
        taken.add(unique)
    return out


def one_line(err: BaseException) -> str:
    """``err`` in one line: its message, and its type where it is not an error of a damaged file (a bug, or a value
    of the run nothing checked)."""
    said = " ".join(str(err).split())[:300]
    return said if isinstance(err, (StoreError, OSError, ValueError)) else f"{type(err).__name__}: {said}"
