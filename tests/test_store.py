"""Runs on disk: round trip, listing, partial reads, crashes, write failures, refusals."""

import collections
import errno
import json
import time

import forked
import pytest
import torch
from reference import KINDS
from tiny_calls import generate

import cogattn
import cogattn.runs.store as store
from cogattn.exact.reducers import REDUCERS
from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline
from cogattn.runs.store import RunWriter, record_file_bytes

QUERIES = [0, (1, 2, 4)]


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


def _stored(kind: str, storage: str) -> str:
    """The dtype docs/streaming.md says a kind's records keep under ``storage``."""
    if kind == "top_p":
        return "int32"
    if kind in ("topk", "frame_max") or (kind in ("received", "pattern_error") and storage == "float16"):
        return "float32"
    return storage


@pytest.mark.parametrize("storage_dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_equals_in_memory_for_every_kind(pipe, tmp_path, storage_dtype):
    with cogattn.record(pipe, kinds=KINDS, heads="all", queries=QUERIES, patterns=("spatial", "temporal")) as mem:
        stock = generate(pipe)
    with cogattn.record(
        pipe,
        kinds=KINDS,
        heads="all",
        queries=QUERIES,
        patterns=("spatial", "temporal"),  # pattern_recall's
        save_dir=tmp_path / "run",
        storage_dtype=storage_dtype,
        info={"prompt": "random embeddings"},
    ) as disk:
        streamed = generate(pipe)
    assert torch.equal(streamed, stock)
    run = cogattn.load(tmp_path / "run")
    assert run.keys() == mem.keys() == disk.keys() and len(run) == len(KINDS) * 2 * 2
    for key in mem.keys():
        stored = _stored(key[0], storage_dtype)
        assert run.record_info(*key).dtype == stored, key
        if key[0] in ("topk", "frame_max"):  # values and indices, kept in float32 whatever the storage dtype
            assert all(
                torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(mem.get(*key), run.get(*key), disk.get(*key))
            )
            continue
        expected = mem.get(*key).to(getattr(torch, stored)).float()
        assert torch.equal(run.get(*key), expected), key
        assert torch.equal(disk.get(*key), expected), key
        assert run.get(*key).dtype == torch.float32, key
        if key[0] == "top_p":  # counts come back exactly, whatever the storage dtype
            assert torch.equal(run.get(*key), mem.get(*key))
    assert run.complete and run.timesteps == mem.timesteps and run.layout == mem.layout
    assert run.meta["info"] == {"prompt": "random embeddings"}
    assert run.meta["model"]["class"] == "CogVideoXTransformer3DModel"
    assert set(run.meta["versions"]) == {"cogattn", "diffusers", "torch"}


@pytest.mark.parametrize("storage_dtype", ["float16", "bfloat16"])
def test_counts_and_sums_past_the_half_precisions_come_back_exactly(tmp_path, storage_dtype):
    """top_p's counts up to S = 93,696 (Kandinsky 5 at 10 s; bfloat16 holds integers exactly only up to 256, float16
    has no finite number above 65,504) come back exactly, as int32 records, or as float32 for the mean over heads;
    received sums past 65,504 stay finite under float16; a top_p record an older version wrote in the storage dtype
    still reads."""
    S = 93_696
    counts = torch.arange(S, dtype=torch.float32).view(1, 1, S // 4, 4)  # every count up to S − 1
    mean = counts + 0.25  # a mean of four heads' counts
    received = torch.linspace(0, S, S).view(1, 1, S)
    half = getattr(torch, storage_dtype)
    assert not torch.equal(counts.to(half).float(), counts)  # what storing counts in the storage dtype did
    for mean_heads, result in ((False, counts), (True, mean)):
        folder = tmp_path / f"mean{mean_heads}"
        writer = RunWriter(store.prepare_folder(folder, False), storage_dtype, mean_heads=mean_heads)
        writer.put("top_p", 0, 0, 999.0, result)
        writer.put("received", 0, 0, 999.0, received)
        writer.close()
        run = cogattn.load(folder)
        assert run.record_info("top_p", 0, 0).dtype == ("float32" if mean_heads else "int32")
        assert run.get("top_p", 0, 0).dtype == torch.float32 and torch.equal(run.get("top_p", 0, 0), result)
        assert torch.equal(run.get("top_p", 0, 0, index=(0, 0, slice(100, 103))), result[0, 0, 100:103])
        got = run.get("received", 0, 0)
        want = received if storage_dtype == "float16" else received.to(half).float()
        assert torch.equal(got, want) and bool(got.isfinite().all())
    # a run written before counts were int32: its top_p record in the storage dtype, read as before
    older = tmp_path / "older"
    writer = RunWriter(store.prepare_folder(older, False), storage_dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(REDUCERS["top_p"], "stored_dtype", classmethod(lambda cls, storage, mean_heads=False: storage))
        writer.put("top_p", 0, 0, 999.0, counts[..., :64, :])
        writer.close()
    run = cogattn.load(older)
    assert run.record_info("top_p", 0, 0).dtype == storage_dtype
    assert torch.equal(run.get("top_p", 0, 0), counts[..., :64, :].to(half).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_record_files_are_standard_safetensors(tmp_path, dtype):
    from safetensors.torch import load_file, save_file

    t = torch.randn(2, 3, 5, 7).to(dtype)
    store.write_record(tmp_path / "ours.safetensors", t)
    save_file({"map": t}, tmp_path / "reference.safetensors")
    assert torch.equal(load_file(tmp_path / "ours.safetensors")["map"], t)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert (tmp_path / "ours.safetensors").stat().st_size == record_file_bytes(tuple(t.shape), dtype)


def test_listing_sizes_and_lazy_partial_reads(pipe, tmp_path):
    with cogattn.record(pipe, kinds=("query", "video_to_text"), heads="all", queries=QUERIES, save_dir=tmp_path) as rec:
        generate(pipe, output_type="latent")
    run = cogattn.load(tmp_path)
    for info in run.records():
        path = tmp_path / info.file
        assert info.nbytes == path.stat().st_size == record_file_bytes(info.shape, torch.float32)
        assert info.timestep == rec.timesteps[info.step]
        assert tuple(run.get(info.kind, info.step, info.layer).shape) == info.shape
    full = run.get("query", 1, 0)
    assert torch.equal(run.get("query", 1, 0, index=(0, 1, slice(0, 1))), full[0, 1, 0:1])
    assert torch.equal(
        run.get("video_to_text", 0, 1, index=(slice(None), 0, 3)), run.get("video_to_text", 0, 1)[:, 0, 3]
    )


def test_non_empty_folder_refused_unless_overwrite(pipe, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(cogattn.StoreError, match="is not empty; choose another `save_dir`, or pass overwrite=True"):
        cogattn.record(pipe, save_dir=tmp_path)
    with pytest.raises(cogattn.StoreError, match="holds no cogattn run, so overwrite=True will not delete it"):
        cogattn.record(pipe, save_dir=tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    run_dir = tmp_path / "run"
    with cogattn.record(pipe, kinds="frame", save_dir=run_dir):
        generate(pipe, steps=2, output_type="latent")
    with cogattn.record(pipe, kinds="frame", save_dir=run_dir, overwrite=True):
        generate(pipe, steps=1, output_type="latent")
    assert len(cogattn.load(run_dir)) == 2  # the old run's 4 records are gone
    assert not pipe.transformer._forward_pre_hooks


def test_run_too_big_for_the_disk_is_refused_with_both_numbers(pipe, tmp_path, monkeypatch):
    free = 10_000
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: usage(free, 0, free))
    expected = 2 * 2 * record_file_bytes((2, 2, 53, 53), torch.float32)  # 2 steps x 2 layers, full, heads all
    with pytest.raises(cogattn.StoreError, match=rf"will write {expected:,} bytes .* has {free:,} bytes .* free"):
        with cogattn.record(pipe, kinds="full", heads="all", batch="all", save_dir=tmp_path / "r"):
            generate(pipe, output_type="latent")
    assert not (tmp_path / "r").exists()  # a run refused before its first record leaves nothing behind


def test_write_failure_mid_run_stops_with_clear_error_and_keeps_committed(pipe, tmp_path, monkeypatch):
    real, calls = store.write_record, []

    def failing(path, tensor):
        calls.append(path)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, tensor)

    monkeypatch.setattr(store, "write_record", failing)
    originals = pipe.transformer.attn_processors
    with pytest.raises(cogattn.StoreError, match=r"No space left on device.*the 3 records committed before it"):
        with cogattn.record(pipe, kinds=("frame", "video_to_text"), save_dir=tmp_path):
            generate(pipe, steps=4, output_type="latent")
    run = cogattn.load(tmp_path)
    assert len(run) == 3 and not run.complete and run.status == "failed"  # run.json says how it ended all the same
    for info in run.records():
        run.get(info.kind, info.step, info.layer)
    assert not list(tmp_path.rglob("*.tmp"))
    assert all(pipe.transformer.attn_processors[n] is originals[n] for n in originals)


def test_a_ctrl_c_while_the_queue_drains_closes_the_run_as_interrupted(pipe, tmp_path, monkeypatch):
    """The second Ctrl-C, while close() waits for a slow disk: the records still queued are dropped, the one being
    written commits, and the run is closed (run.json says interrupted, the lock is released) before the interrupt goes
    on; a second recording into the folder is not refused."""
    import signal
    import threading

    from cogattn.runs.folder import is_locked

    real, close = store.write_record, RunWriter.close

    def slow(path, tensor):
        time.sleep(0.25)
        real(path, tensor)

    def interrupted_close(self, meta=None):  # a real SIGINT: it wakes the wait as a Ctrl-C does
        main = threading.main_thread().ident
        threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT)).start()
        return close(self, meta)

    monkeypatch.setattr(store, "write_record", slow)
    monkeypatch.setattr(RunWriter, "close", interrupted_close)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever runs the tests
    with pytest.raises(KeyboardInterrupt):
        with cogattn.record(pipe, kinds=("frame", "video_to_text"), save_dir=tmp_path / "run") as rec:
            generate(pipe, steps=2, output_type="latent")  # 8 records, queued faster than they are written
    signal.signal(signal.SIGINT, handler)
    monkeypatch.undo()
    run = cogattn.load(tmp_path / "run")
    assert rec.status == run.status == "interrupted" and not run.complete and not is_locked(tmp_path / "run")
    assert 1 <= len(run) < 8 and not list((tmp_path / "run").rglob("*.tmp"))
    for info in run.records():
        run.get(info.kind, info.step, info.layer)
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path / "run", overwrite=True):
        generate(pipe, steps=1, output_type="latent")
    assert cogattn.load(tmp_path / "run").status == "finished"


def test_an_overwrite_cut_short_leaves_a_run_that_overwrite_replaces(pipe, tmp_path, monkeypatch):
    """A kill while overwrite=True deletes an old run's records (many files: seconds) leaves a folder that is still a
    run, which the next overwrite=True replaces; it was refused as holding "no cogattn run"."""
    from cogattn.runs import folder

    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path):
        generate(pipe, steps=1, output_type="latent")

    def killed(path, **kw):
        next(path.rglob("*.safetensors")).unlink()  # part of the records gone
        raise KeyboardInterrupt

    monkeypatch.setattr(folder.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        store.prepare_folder(tmp_path, overwrite=True)
    monkeypatch.undo()
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path, overwrite=True):
        generate(pipe, steps=1, output_type="latent")
    assert cogattn.load(tmp_path).status == "finished"


def test_writer_memory_is_bounded_while_the_disk_is_slow(tmp_path, monkeypatch):
    """A queue of 3 MiB holds three 1 MiB records: from the fourth on, each put waits for a write."""
    real, pending = store.write_record, []

    def slow(path, tensor):
        pending.append(writer.pending_bytes)
        time.sleep(0.02)
        real(path, tensor)

    monkeypatch.setattr(store, "write_record", slow)
    writer = RunWriter(store.prepare_folder(tmp_path, False), max_pending_bytes=3 * 2**20)
    t = torch.ones(1, 1, 2**9, 2**9)  # 1 MiB, shaped as a frame record (B, H, G, G): a reader checks the axes
    t0 = time.perf_counter()
    for step in range(12):
        writer.put("frame", step, 0, 1.0, t * step)
    puts = time.perf_counter() - t0
    writer.close({"complete": True})
    assert puts >= (12 - 3 - 1) * 0.02  # generation waited for the disk instead of queueing everything
    assert writer.blocked_seconds > 0.02  # put() itself waited (a busy machine makes puts slower, not faster)
    assert max(pending) <= 3 * 2**20 and len(pending) == 12
    run = cogattn.load(tmp_path)
    assert [k[1] for k in run.keys()] == list(range(12))
    for step in range(12):
        assert torch.equal(run.get("frame", step, 0), t * step)


def _record_until_killed(out, started) -> None:
    """A long generation recorded to disk, in a child the test kills."""
    pipe = tiny_pipeline(num_heads=4)
    emb = torch.randn(1, TINY_TEXT_LEN, 16)
    with cogattn.record(pipe, kinds=("full", "frame", "video_to_text"), heads="all", save_dir=out):
        started.set()
        pipe(
            prompt_embeds=emb,
            negative_prompt_embeds=-emb,
            num_frames=9,
            height=96,
            width=160,
            num_inference_steps=200,
            max_sequence_length=TINY_TEXT_LEN,
            output_type="latent",
        )


def test_sigkill_at_several_moments_leaves_a_readable_run(tmp_path):
    for i, wait_lines in enumerate([0, 1, 40]):
        out = tmp_path / f"run{i}"
        started = forked.event()
        proc = forked.start(_record_until_killed, out, started)
        assert started.wait(60)
        deadline = time.time() + 60
        manifest = out / "manifest.jsonl"
        while time.time() < deadline and manifest.read_text().count("\n") < wait_lines:
            time.sleep(0.002)
        assert manifest.read_text().count("\n") >= wait_lines, "the recording made no progress in 60 s"
        forked.kill(proc)
        run = cogattn.load(out)
        assert len(run) >= wait_lines and not run.complete
        for info in run.records():
            assert (out / info.file).stat().st_size == info.nbytes == record_file_bytes(info.shape, torch.float32)
            t = run.get(info.kind, info.step, info.layer)
            assert t.shape == info.shape and torch.isfinite(t).all()
        listed = {out / r.file for r in run.records()}
        unlisted = [p for p in out.rglob("*.safetensors") if p not in listed]
        assert len(unlisted) + len(list((out / "records").rglob("*.tmp"))) <= 1  # only the record in flight is lost
        meta = json.loads((out / "run.json").read_text())
        assert meta["complete"] is False
        if len(run):
            assert run.timesteps[0] == 999.0


def test_overwrite_never_deletes_a_folder_that_is_not_a_cogattn_run(pipe, tmp_path):
    (tmp_path / "run.json").write_text('{"format": "someone-else"}')
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "theirs.bin").write_bytes(b"x")
    with pytest.raises(cogattn.StoreError, match="holds no cogattn run"):
        cogattn.record(pipe, save_dir=tmp_path, overwrite=True)
    assert (tmp_path / "records" / "theirs.bin").exists()


def test_a_folder_whose_lock_cannot_be_written_is_named_not_said_to_be_busy(tmp_path, monkeypatch):
    """A full disk or a read-only prompt folder: RunLock's StoreError names the folder (before, a bare OSError, and
    the batch tool said another process was writing it); only a held lock is LockHeldError."""
    import io

    import cogattn.dump.generate as generate
    from cogattn.runs import folder as runs_folder

    class FullDisk(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runs_folder, "open", lambda path, mode: FullDisk(), raising=False)
    monkeypatch.setattr(runs_folder, "fcntl", None)  # the lock taken, its holder's line fails to write
    with pytest.raises(cogattn.StoreError, match=r"cannot write to '.*a': No space left on device") as err:
        runs_folder.RunLock(tmp_path / "a")
    assert not isinstance(err.value, runs_folder.LockHeldError)
    monkeypatch.undo()
    held = runs_folder.RunLock(tmp_path)

    def unwritable(folder):
        raise cogattn.StoreError(f"cannot write to {str(folder)!r}: Read-only file system; choose another save_dir.")

    monkeypatch.setattr(generate, "RunLock", unwritable)
    with pytest.raises(cogattn.StoreError, match="Read-only file system"):
        generate.run_prompt(None, None, None, tmp_path / "p", 0, True, True)
    monkeypatch.undo()
    with pytest.raises(runs_folder.LockHeldError, match="being written by another recording"):
        runs_folder.RunLock(tmp_path)  # a lock held (here, by this process's other file)
    held.release()


def test_a_run_killed_before_its_run_json_is_replaced_by_overwrite(tmp_path, monkeypatch):
    """A kill between the manifest and run.json leaves manifest.jsonl, .lock and run.json.tmp: load reads it as a
    stopped run, so overwrite=True replaces it (it was refused as holding no run) and leaves no run.json.tmp; a
    Ctrl-C inside write_json_atomic leaves no temporary file."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("manifest.jsonl", ".lock", "run.json.tmp"):
        (run / name).write_text("")
    assert cogattn.load(run).status == "stopped"
    store.prepare_folder(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.jsonl").write_text("")
    (tmp_path / "other" / "notes.txt").write_text("mine")  # not a run's: never deleted
    with pytest.raises(cogattn.StoreError, match="holds no cogattn run"):
        store.prepare_folder(tmp_path / "other", overwrite=True)

    def interrupted(path, mode, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.os, "open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.write_json_atomic(tmp_path / "x.json", {})
    monkeypatch.undo()
    (tmp_path / "x.json.tmp").write_text("")  # left by a Ctrl-C after the open: cleaned by the next failure too
    monkeypatch.setattr(store.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        store.write_json_atomic(tmp_path / "x.json", {})
    assert not (tmp_path / "x.json.tmp").exists()
