"""Fault injection: a filesystem that fails at every write point of a run in turn.

For each point (the record file, its rename, the manifest append, run.json, closing the manifest) and
each time the run reaches it, the write fails with "no space left" (a manifest append first writes
half its line, as a full disk does). Whatever fails, the user's own exception is never masked, every
record the run lists loads and equals the in-memory result, and nothing half-written is served."""

import errno
import os
import warnings

import pytest
import torch
from tiny_calls import generate

import cogattn
import cogattn.runs.store as store
from cogattn.models.cogvideox import tiny_pipeline

KINDS = ("frame", "video_to_text")


class FullDisk:
    """Stands in for the ``os`` module inside cogattn.runs.store: the ``nth`` call of ``name`` fails."""

    def __init__(self, name: str, nth: int):
        self.name, self.nth, self.calls, self.failed = name, nth, 0, False

    def __getattr__(self, attr):
        real = getattr(os, attr)
        if attr != self.name:
            return real

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls != self.nth:
                return real(*args, **kwargs)
            self.failed = True
            if attr == "write":  # a torn write: half the bytes reach the file
                fd, data = args
                real(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        return call


class FailingRecordFile:
    """Stands in for ``store.write_record``: the ``nth`` record file is cut short by a full disk."""

    def __init__(self, nth: int):
        self.nth, self.calls, self.failed = nth, 0, False
        self.real = store.write_record

    def __call__(self, path, tensor):
        self.calls += 1
        if self.calls != self.nth:
            return self.real(path, tensor)
        self.failed = True
        with open(path, "wb") as f:
            f.write(b"\0" * 16)
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


@pytest.fixture(scope="module")
def expected(pipe):
    with cogattn.record(pipe, kinds=KINDS) as rec:
        generate(pipe, steps=1, output_type="latent")
    return {key: rec.get(*key) for key in rec.keys()}


# Calls each write point sees in a 1-step run of 2 kinds × 2 layers: run.json at the start and at the first
# step, the 4 records (file, rename, manifest line), run.json and the manifest's close at the end. The last
# number of each point never fails. With the user's error the faults that matter come after the block.
RECORDS = 4
POINTS = (
    [("write_record", n, False) for n in range(1, RECORDS + 2)]
    + [(name, n, False) for name in ("replace", "write") for n in range(1, RECORDS + 5)]
    + [("close", n, False) for n in range(1, 6)]
    + [
        ("replace", RECORDS + 3, True),
        ("write", RECORDS + 3, True),
        ("close", 3, True),
        ("close", 4, True),
        ("close", 5, True),
    ]  # run.json at the end, the manifest's close, and no fault
)


@pytest.mark.parametrize(
    "point,nth,users_error", POINTS, ids=[f"{p}-{n}{'-user-error' if u else ''}" for p, n, u in POINTS]
)
def test_a_failing_write_never_masks_the_user_and_never_serves_half_a_record(
    pipe, expected, tmp_path, monkeypatch, point, nth, users_error
):
    fault = FailingRecordFile(nth) if point == "write_record" else FullDisk(point, nth)
    monkeypatch.setattr(store, *(("write_record", fault) if point == "write_record" else ("os", fault)))
    folder = tmp_path / "run"
    raised, reached = None, False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with cogattn.record(pipe, kinds=KINDS, save_dir=folder):
                generate(pipe, steps=1, output_type="latent")
                reached = True  # capture stops the generation with StoreError when a write fails in it
                if users_error:
                    raise ValueError("the user's own error")
        except Exception as err:
            raised = err
    monkeypatch.undo()
    closing = [w for w in seen if "closing the recording after ValueError also failed" in str(w.message)]
    assert len(closing) == (users_error and fault.failed)  # a failure at close is said, as a warning
    never = {"write_record": RECORDS + 1, "replace": RECORDS + 4, "write": RECORDS + 4, "close": 5}[point]
    assert fault.failed == (nth < never)  # every write point above is reached, as many times as counted
    if users_error:
        assert reached
        assert isinstance(raised, ValueError) and str(raised) == "the user's own error"  # never masked
    elif fault.failed:
        assert isinstance(raised, cogattn.StoreError) and isinstance(raised.__cause__, OSError), raised
    else:
        assert raised is None
    assert not list(tmp_path.rglob("*.tmp"))
    if not (folder / "manifest.jsonl").exists():
        assert fault.failed and not folder.exists()  # refused at the start: nothing left behind
        return
    run = cogattn.load(folder)
    assert set(run.keys()) <= set(expected)
    for key in run.keys():
        assert torch.equal(run.get(*key), expected[key]), key  # every listed record is whole and right
    if not fault.failed:
        assert run.keys() == sorted(expected) and run.status == ("failed" if users_error else "finished")
    else:
        assert run.status != "finished" or (point, raised) == ("close", None)
