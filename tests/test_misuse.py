"""What happens when the API is misused: nothing silently wrong, nothing lost, every refusal one clear line.

Each test is one promise of "What happens when" in docs/streaming.md."""

import gc
import json
import os
import shutil
import time
import warnings
from collections import namedtuple
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from reference import QKSpy, assert_matches_naive
from tiny_calls import generate

import cogattn
import cogattn.runs.store as store
from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline


@pytest.fixture
def pipe():
    return tiny_pipeline()


def _hooks(pipe) -> int:
    return len(pipe.transformer._forward_pre_hooks)


# -- silent wrong results ----------------------------------------------------------------------------
def test_an_open_run_is_locked_against_a_second_recording(pipe, tmp_path):
    run_dir = tmp_path / "run"
    with cogattn.record(pipe, kinds="frame", save_dir=run_dir, info={"who": "first"}) as first:
        generate(pipe, steps=1, output_type="latent")
        with pytest.raises(cogattn.StoreError, match=r"is being written by another recording \(process \d+\)"):
            cogattn.record(tiny_pipeline(), kinds="frame", save_dir=run_dir, overwrite=True)
        with pytest.raises(ValueError, match="close the other recording first"):  # the same pipeline: refused sooner
            cogattn.record(pipe, kinds="frame", save_dir=run_dir, overwrite=True)
    run = cogattn.load(run_dir)
    assert run.complete and run.info == {"who": "first"} and len(run) == 2
    for key in run.keys():
        assert torch.equal(run.get(*key), first.get(*key))
    with cogattn.record(pipe, kinds="frame", save_dir=run_dir, overwrite=True, info={"who": "second"}):
        generate(pipe, steps=2, output_type="latent")  # closed runs can be replaced
    assert cogattn.load(run_dir).info == {"who": "second"} and len(cogattn.load(run_dir)) == 4


def _hold_the_lock(run_dir, locked) -> None:
    from cogattn.runs.folder import RunLock

    lock = RunLock(run_dir)  # noqa: F841 (held until the process is killed)
    locked.set()
    time.sleep(60)


def test_the_lock_of_a_killed_writer_is_released(pipe, tmp_path):
    run_dir = tmp_path / "run"
    with cogattn.record(pipe, kinds="frame", save_dir=run_dir):
        generate(pipe, steps=1, output_type="latent")
    locked = forked.event()
    holder = forked.start(_hold_the_lock, run_dir, locked)
    try:
        assert locked.wait(60)
        with pytest.raises(cogattn.StoreError, match="being written by another recording"):
            cogattn.record(pipe, save_dir=run_dir, overwrite=True)
        assert cogattn.load(run_dir).status == "finished"
    finally:
        forked.kill(holder)
    with cogattn.record(pipe, kinds="frame", save_dir=run_dir, overwrite=True):
        generate(pipe, steps=1, output_type="latent")


def test_batch_and_head_lists_keep_their_order(pipe, tmp_path):
    pipe = tiny_pipeline(num_heads=4)
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds="frame", batch=[1, 0], heads=[3, 0], save_dir=tmp_path / "r") as rec:
        generate(pipe, steps=1, output_type="latent")
    spy.remove()
    assert rec.batch_items == (1, 0) and rec.head_ids == (3, 0)
    assert_matches_naive(rec, spy, [1, 0], [3, 0], kinds=("frame",))
    run = cogattn.load(tmp_path / "r")
    assert run.head_ids == (3, 0) and run.meta["selection"]["batch"] == [1, 0]
    with pytest.raises(ValueError, match=r"heads lists index 3 twice"):
        cogattn.record(pipe, heads=[3, 0, 3])


def test_every_head_in_another_order_is_not_taken_for_all_heads():
    pipe = tiny_pipeline(num_heads=3)
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds=("frame", "query"), queries=[5], heads=[2, 1, 0], method="sdpa") as rec:
        generate(pipe, steps=1, output_type="latent")
    spy.remove()
    assert rec.head_ids == (2, 1, 0)
    assert_matches_naive(rec, spy, [1], [2, 1, 0], kinds=("frame", "query"), queries=[5])


@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_boolean_options_take_booleans(pipe, value):
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        cogattn.record(pipe, overwrite=value)
    assert _hooks(pipe) == 0


def test_an_interrupted_generation_is_marked_interrupted(pipe, tmp_path):
    def stop_after_two(p, i, t, kw):
        p._interrupt = i >= 1  # the pipelines' own interrupt flag
        return kw

    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path / "r") as rec:
        generate(pipe, steps=4, callback_on_step_end=stop_after_two, output_type="latent")
    run = cogattn.load(tmp_path / "r")
    assert rec.status == run.status == "interrupted" and not run.complete
    assert run.num_steps == run.meta["steps"] == 2 and len(run) == 2 * 2
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path / "s") as rec:
        generate(pipe, steps=2, output_type="latent")
    assert cogattn.load(tmp_path / "s").status == "finished" and rec.status == "finished"


def test_failed_and_ctrl_c_generations_say_so(pipe, tmp_path):
    for exc, status in ((RuntimeError, "failed"), (KeyboardInterrupt, "interrupted")):

        def boom(p, i, t, kw, exc=exc):
            if i == 1:
                raise exc("stop")
            return kw

        with pytest.raises(exc), cogattn.record(pipe, kinds="frame", save_dir=tmp_path / status):
            generate(pipe, steps=3, callback_on_step_end=boom, output_type="latent")
        run = cogattn.load(tmp_path / status)
        assert run.status == status and run.num_steps == 2 and len(run) == 4


def test_a_transformer_called_twice_at_one_timestep_is_refused(pipe):
    t = pipe.transformer
    x, text = torch.randn(1, 3, 4, 6, 10), torch.randn(1, 8, 16)
    with pytest.raises(RuntimeError, match=r"called again at timestep 500 \(step 0\)"), cogattn.record(t) as rec:
        t(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([500]))
        t(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([500]))
    assert rec.timesteps == [500.0] and rec.status == "failed"  # the first call stays: it ran


# -- crashes and lost work -----------------------------------------------------------------------------
def test_a_dropped_recording_takes_its_hook_with_it(pipe):
    stock = generate(pipe)
    rec = cogattn.Recording(pipe)
    assert _hooks(pipe) == 1
    del rec
    gc.collect()
    assert _hooks(pipe) == 0
    assert torch.equal(generate(pipe), stock) and torch.equal(generate(pipe), stock)


def test_a_dropped_recording_of_results_in_memory_stops_recording(pipe):
    """Its processors hold it weakly: dropped, it is collected and the stock processors are back (before, they kept
    it alive and recorded the next generation where no one could read it)."""
    stock, originals = generate(pipe, output_type="latent"), pipe.transformer.attn_processors
    cogattn.record(pipe, kinds="frame")  # the result dropped at once
    gc.collect()
    assert _hooks(pipe) == 0 and all(pipe.transformer.attn_processors[n] is originals[n] for n in originals)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no recording left open to close
        assert torch.equal(generate(pipe, output_type="latent"), stock)


def test_another_call_at_a_lower_timestep_is_another_generation(pipe):
    """Video-to-video at a small strength starts below the last generation's timesteps: told at its first call by
    the scheduler's timesteps set anew (before, its steps were appended to the first generation's)."""
    from diffusers import CogVideoXVideoToVideoPipeline

    v2v = CogVideoXVideoToVideoPipeline(**pipe.components)
    v2v.set_progress_bar_config(disable=True)
    emb = torch.randn(1, TINY_TEXT_LEN, 16, generator=torch.Generator().manual_seed(0))
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, height=48, width=80, output_type="latent")
    call.update(video=[torch.rand(3, 48, 80, generator=torch.Generator().manual_seed(i)) for i in range(9)])
    with pytest.raises(RuntimeError, match="a second generation started"), cogattn.record(v2v) as rec:
        v2v(**call, num_inference_steps=2, strength=1.0, max_sequence_length=TINY_TEXT_LEN)
        first = list(rec.timesteps)
        v2v(**call, num_inference_steps=50, strength=0.1, max_sequence_length=TINY_TEXT_LEN)
    assert rec.timesteps == first == [999.0, 499.0]  # the second call's 99, 79, ... are not appended
    assert {step for _, step, _ in rec.keys()} == {0, 1}


def _call(pipe, height=48, **kwargs):
    emb = torch.randn(1, TINY_TEXT_LEN, 16, generator=torch.Generator().manual_seed(0))
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, num_frames=9, height=height, width=80)
    return pipe(**call, max_sequence_length=TINY_TEXT_LEN, output_type="latent", **kwargs)


@pytest.mark.parametrize(
    "scheduler, options",
    [("EulerDiscreteScheduler", dict(timesteps=[800, 500, 700, 200])), ("PNDMScheduler", dict(num_inference_steps=4))],
    ids=["custom timesteps that rise", "PNDM's repeated timesteps"],
)
def test_a_schedule_that_rises_or_repeats_is_one_generation_step_by_step(pipe, scheduler, options):
    """A pipeline's own schedule tells its steps: custom timesteps that rise mid-schedule (a step above the last was
    taken for another generation, and the call refused), PNDM's repeated timesteps (its ``counter``, with no
    ``step_index``: a repeat was refused as a second call at one timestep). Each call is a step, its maps exact."""
    import diffusers

    extra = dict(skip_prk_steps=False) if scheduler == "PNDMScheduler" else {}  # PNDM's Runge-Kutta steps too
    pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config, **extra)
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: calls.append(float(kw["timestep"][0])), with_kwargs=True
    )
    spy = QKSpy(pipe.transformer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PNDM's config warns of CogVideoX's keys
        with cogattn.record(pipe, kinds=("frame",), heads=[0, 1], batch="all") as rec:
            _call(pipe, **options)
    hook.remove()
    assert rec.status == "finished" and rec.timesteps == calls and len(calls) >= 4
    assert len(set(calls)) < len(calls) if scheduler == "PNDMScheduler" else calls == [800.0, 500.0, 700.0, 200.0]
    assert_matches_naive(rec, spy, [0, 1], [0, 1], kinds=("frame",))


def test_a_second_call_of_another_size_inside_one_recording_is_refused(pipe):
    """The first call stopped by its callback after a step, then a call of another size starting below it: another
    generation (its schedule set anew), refused inside a ``with``, not taken for the first one going on."""

    def stop(p, i, t, kwargs):
        p._interrupt = True
        return kwargs

    from diffusers import EulerDiscreteScheduler

    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)  # it takes custom timesteps
    with pytest.raises(RuntimeError, match="a second generation started"), cogattn.record(pipe) as rec:
        _call(pipe, num_inference_steps=4, callback_on_step_end=stop)
        _call(pipe, 64, timesteps=[200, 100])
    assert rec.timesteps == [999.0] and rec.status == "failed"


def test_another_pipeline_running_the_recorded_transformer_is_refused(pipe):
    """A pipeline made from the recorded one's components runs its transformer: its guidance and steps are not the
    recorded pipeline's (before, guidance read off gave the negative prompt's item as the prompt's); refused at its
    first call, the recording left as it was, and the recorded pipeline's own call recorded."""
    from diffusers import CogVideoXPipeline

    other = CogVideoXPipeline(**pipe.components)
    other.set_progress_bar_config(disable=True)
    rec = cogattn.record(pipe, kinds="frame")
    with pytest.raises(ValueError, match=r"another pipeline \(CogVideoXPipeline\) than the one recorded"):
        generate(other, output_type="latent")
    assert rec.timesteps == [] and rec.status == "running"
    generate(pipe, output_type="latent")
    rec.close()
    assert rec.batch_roles == ("cond",) and len(rec.timesteps) == 2 and rec.status == "finished"


def test_a_recording_left_open_after_a_failed_first_step_is_closed_interrupted(pipe, tmp_path):
    """The next generation starts at the same timestep, its scheduler set anew: the open recording is closed (before,
    every later call was refused as a second call at that timestep); a recording closed by hand short of its steps
    reads interrupted, not finished and complete."""
    rec = cogattn.record(pipe, kinds="frame", save_dir=tmp_path / "run")

    def fail(pipeline, i, t, kwargs):
        raise ValueError("a callback's mistake")

    with pytest.raises(ValueError, match="a callback's mistake"):
        generate(pipe, steps=3, output_type="latent", callback_on_step_end=fail)
    stock = tiny_pipeline()  # a pipeline of the same weights, never recorded
    with pytest.warns(UserWarning, match="the recording was closed with its 1 steps"):
        out = generate(pipe, output_type="latent")
    assert torch.equal(out, generate(stock, output_type="latent")) and _hooks(pipe) == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (rec.status, run["status"], run["complete"], run["steps"]) == ("interrupted", "interrupted", False, 1)
    rec = cogattn.record(pipe, kinds="frame")

    def ctrl_c_at_step_1(pipeline, i, t, kwargs):
        if i == 1:
            raise KeyboardInterrupt
        return kwargs

    with pytest.raises(KeyboardInterrupt):
        generate(pipe, steps=3, output_type="latent", callback_on_step_end=ctrl_c_at_step_1)
    rec.close()
    assert (rec.status, len(rec.timesteps)) == ("interrupted", 2)
    rec = cogattn.record(pipe, kinds="frame")
    generate(pipe, steps=3, output_type="latent")
    rec.close()
    assert (rec.status, len(rec.timesteps)) == ("finished", 3)


def test_a_recording_left_open_closes_at_the_next_generation(pipe):
    stock = generate(pipe)
    originals = pipe.transformer.attn_processors
    rec = cogattn.record(pipe, kinds="frame")  # no `with`, never closed
    assert torch.equal(generate(pipe), stock)
    with pytest.warns(UserWarning, match="the recording was closed with its 2 steps"):
        second = generate(pipe)
    assert torch.equal(second, stock) and torch.equal(generate(pipe), stock)
    assert rec.status == "finished" and len(rec.keys()) == 4 and _hooks(pipe) == 0
    assert all(pipe.transformer.attn_processors[n] is originals[n] for n in originals)


def test_a_refused_first_call_leaves_the_recording_usable(pipe):
    rec = cogattn.record(pipe, kinds="frame", steps=[3])  # no `with`: the refusal leaves it open
    with pytest.raises(ValueError, match="asks for step 3"):
        generate(pipe, steps=2, output_type="latent")
    assert rec.timesteps == [] and rec.layout is None  # as if the refused call never happened
    captured = generate(pipe, steps=4)
    rec.close()
    assert len(rec.timesteps) == 4 and rec.keys() == [("frame", 3, 0), ("frame", 3, 1)]
    assert torch.equal(captured, generate(pipe, steps=4))


def test_a_recording_that_saw_no_generation_is_not_failed(pipe, tmp_path):
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path / "run") as rec:
        pass
    assert rec.status == "finished" and cogattn.load(tmp_path / "run").num_steps == 0


def test_a_closed_recording_cannot_be_entered_again(pipe):
    rec = cogattn.record(pipe, kinds="frame")
    rec.close()
    with pytest.raises(RuntimeError, match="this recording is closed"), rec:
        pass


def test_run_json_failing_at_close_never_masks_the_users_error(pipe, tmp_path, monkeypatch):
    real = store.write_json_atomic
    calls = []

    def full_disk_at_close(path, obj):
        calls.append(obj.get("status"))
        if obj.get("status") != "running":
            raise cogattn.StoreError("writing run.json failed: No space left on device.") from OSError(28, "full")
        real(path, obj)

    monkeypatch.setattr(store, "write_json_atomic", full_disk_at_close)
    with pytest.warns(UserWarning, match="closing the recording after ValueError also failed"):
        with pytest.raises(ValueError, match="mine"), cogattn.record(pipe, kinds="frame", save_dir=tmp_path / "a"):
            generate(pipe, steps=1, output_type="latent")
            raise ValueError("mine")
    with pytest.raises(cogattn.StoreError, match="No space left") as err:
        with cogattn.record(pipe, kinds="frame", save_dir=tmp_path / "b"):
            generate(pipe, steps=1, output_type="latent")
    assert isinstance(err.value.__cause__, OSError)
    for folder in ("a", "b"):
        assert not list((tmp_path / folder).rglob("*.tmp"))
        run = cogattn.load(tmp_path / folder)
        assert len(run) == 2 and run.status == "stopped"  # records kept; run.json still says it was running


def test_damaged_manifest_lines_are_skipped_and_reported(pipe, tmp_path):
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path) as rec:
        generate(pipe, steps=2, output_type="latent")
    expected = {key: rec.get(*key) for key in rec.keys()}
    manifest = tmp_path / "manifest.jsonl"
    lines = manifest.read_bytes().split(b"\n")[:-1]
    huge = [lines[1].replace(b'"step": 0', b'"step": Infinity'), lines[1].replace(b"999.0", b"1" + b"0" * 400)]
    damaged = [lines[0], b"garbage {", b"", lines[1], b'{"kind": "frame"}', lines[2], lines[3], *huge, b"\0" * 40]
    manifest.write_bytes(b"\n".join(damaged) + b"\n" + b"\0" * 100)  # and a zero-filled tail, never committed
    with pytest.warns(UserWarning, match=r"6 line\(s\) of .*manifest.jsonl.* cannot be read"):
        run = cogattn.load(tmp_path)
    assert [s.split(":")[1] for s in run.skipped_lines] == ["2", "3", "5", "8", "9", "10"]
    assert all("OverflowError" in s for s in run.skipped_lines[3:5]), run.skipped_lines  # infinite, 400 digits
    assert "zero bytes" in run.skipped_lines[-1]
    assert run.keys() == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(run.get(*key), value)


@pytest.mark.parametrize("name", ["run.json", "manifest.jsonl", "record"])
def test_a_pipe_in_place_of_a_runs_file_is_refused_not_waited_on(pipe, tmp_path, name):
    """A FIFO (tar and rsync -a carry them) where a run's file should be: opening it would block for ever."""
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path):
        generate(pipe, steps=1, output_type="latent")
    file = tmp_path / (cogattn.load(tmp_path).record_info("frame", 0, 1).file if name == "record" else name)
    file.unlink()
    os.mkfifo(file)
    with pytest.raises(cogattn.StoreError, match=r"is not a regular file"):
        cogattn.load(tmp_path).get("frame", 0, 1)


def test_numbers_past_a_floats_range_in_run_json_are_refused_in_one_line(pipe, tmp_path):
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path):
        generate(pipe, steps=1, output_type="latent")
    meta = json.loads((tmp_path / "run.json").read_text())
    meta["timesteps"] = [10**400]
    (tmp_path / "run.json").write_text(json.dumps(meta))
    with pytest.raises(cogattn.StoreError, match=r"timesteps.*a number") as err:
        cogattn.load(tmp_path)
    assert "\n" not in str(err.value)


def test_heads_all_without_their_list_are_the_configs_count_and_lines_of_another_are_skipped(pipe, tmp_path):
    """A run.json of heads='all' that does not list its heads: the model config's count stands for them; a record
    of another head count is skipped, not served to a reader that indexes heads by the config."""
    with cogattn.record(pipe, kinds="frame", heads="all", save_dir=tmp_path):
        generate(pipe, steps=1, output_type="latent")
    meta = json.loads((tmp_path / "run.json").read_text())
    meta["selection"]["heads_resolved"] = None  # as a run of an earlier version writes it
    del meta["selection"]["source_heads"]
    (tmp_path / "run.json").write_text(json.dumps(meta))
    heads = meta["model"]["config"]["num_attention_heads"]
    run = cogattn.load(tmp_path)
    assert run.head_ids == tuple(range(heads)) and len(run) == 2
    meta["model"]["config"]["num_attention_heads"] = heads + 1
    (tmp_path / "run.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=r"2 line\(s\)"):
        run = cogattn.load(tmp_path)
    assert len(run) == 0 and all("head" in s for s in run.skipped_lines)


def test_overwrite_removes_a_link_in_the_run_and_writes_nothing_through_it(pipe, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("mine")
    run_dir = tmp_path / "run"
    with cogattn.record(pipe, kinds="frame", save_dir=run_dir):
        generate(pipe, steps=1, output_type="latent")
    records = run_dir / "records"
    shutil.rmtree(records)
    records.symlink_to(outside, target_is_directory=True)  # a shared run whose records are a link
    with cogattn.record(pipe, kinds="frame", save_dir=run_dir, overwrite=True):
        generate(pipe, steps=1, output_type="latent")
    assert [p.name for p in outside.iterdir()] == ["notes.txt"] and not records.is_symlink()
    assert len(cogattn.load(run_dir)) == 2


def test_a_damaged_record_file_is_named(pipe, tmp_path):
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path):
        generate(pipe, steps=1, output_type="latent")
    run = cogattn.load(tmp_path)
    info = run.record_info("frame", 0, 1)
    (tmp_path / info.file).write_bytes(b"\x05" * 20)
    with pytest.raises(cogattn.StoreError, match=r"record file .*step0000_layer001.safetensors' cannot be read"):
        run.get("frame", 0, 1)
    assert run.get("frame", 0, 0).shape == (1, 1, 4, 4)


@pytest.mark.parametrize("idiom", ["wrapper", "in-place"])
def test_a_compiled_transformer_is_recorded_uncompiled_and_compiled_again(pipe, idiom):
    stock = generate(pipe)
    if idiom == "wrapper":
        pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    else:
        pipe.transformer.compile(backend="eager")
    compiled = (pipe.transformer, getattr(pipe.transformer, "_compiled_call_impl", None))
    spy = QKSpy(getattr(pipe.transformer, "_orig_mod", pipe.transformer))
    with pytest.warns(
        UserWarning, match="compiled with torch.compile; while this recording is open it runs uncompiled"
    ):
        with cogattn.record(pipe, kinds=("frame", "video_to_text")) as rec:
            out = generate(pipe)
    spy.remove()
    assert torch.equal(out, stock)
    assert_matches_naive(rec, spy, [1], "mean", kinds=("frame", "video_to_text"))
    assert (pipe.transformer, getattr(pipe.transformer, "_compiled_call_impl", None)) == compiled
    if idiom == "wrapper":
        with pytest.raises(TypeError, match=r"record the module inside it, `cogattn.record\(compiled._orig_mod"):
            cogattn.record(pipe.transformer)


@pytest.mark.parametrize("durable", [False, True])
def test_durable_puts_each_record_and_its_manifest_line_on_the_disk_before_the_next(
    pipe, tmp_path, monkeypatch, durable
):
    """``durable=True``: every record file is flushed before it takes its name, and its manifest line before the next
    record (a power loss then leaves no line naming bytes that never reached the disk); by default nothing is."""
    synced, fsync = [], os.fsync

    def counting(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else fd)
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", counting)
    with cogattn.record(pipe, kinds=("frame", "entropy"), save_dir=tmp_path / "run", durable=durable) as rec:
        generate(pipe, output_type="latent")
    records = len(rec.keys())
    assert records == 2 * 2 * len(rec.timesteps) and cogattn.load(tmp_path / "run").keys() == rec.keys()
    files = [str(p) for p in synced if str(p).endswith(".safetensors.tmp")]
    manifest = [p for p in synced if str(p).endswith("manifest.jsonl")]
    assert (len(files), len(manifest)) == ((records, records) if durable else (0, 0))
    with pytest.raises(TypeError, match="durable must be True or False"):
        cogattn.CaptureOptions(durable="yes")


def test_free_space_counts_whole_blocks(pipe, tmp_path, monkeypatch):
    """Many small records take a whole block each: 4 records of 1 KB need 4 blocks of 4 KiB, not 4 KB."""
    usage = namedtuple("usage", "total used free")
    statvfs = namedtuple("statvfs", "f_frsize f_bsize")
    monkeypatch.setattr(store.os, "statvfs", lambda path: statvfs(4096, 4096))
    record_bytes = store.record_file_bytes((1, 1, 53, 53), torch.float32)  # 'full' at heads='mean': ~11 KB
    free = 4 * record_bytes + 1000  # the sum of the file sizes fits; their blocks do not
    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: usage(free, 0, free))
    with pytest.raises(cogattn.StoreError, match=rf"{4 * record_bytes:,} bytes .* bytes of disk in whole blocks"):
        with cogattn.record(pipe, kinds="full", save_dir=tmp_path / "r"):
            generate(pipe, steps=2, output_type="latent")
    assert not (tmp_path / "r").exists()


# -- refusals as one clear line ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(kinds=None), TypeError, r"kinds must be a kind or a list of kinds .* got None"),
        (dict(info="prompt"), TypeError, r"info must be a dict"),
        (dict(memory_budget="0.1"), ValueError, r"memory_budget='0.1' is less than one byte"),
        (dict(memory_budget="1e400"), ValueError, r"memory_budget='1e400' is more bytes than a float holds"),
        (dict(memory_budget="1e308GiB"), ValueError, r"memory_budget='1e308GiB' is more bytes than a float holds"),
        (dict(storage_dtype="int8"), ValueError, r"storage_dtype='int8' is not one of"),
        (dict(method="rows", layer_output="joint"), ValueError, "Leave method='auto'"),
        (dict(save_dir=3), TypeError, "save_dir must be a folder path"),
        (dict(save_dir=""), TypeError, "save_dir must be a folder path"),  # not the working folder by accident
        (dict(kinds="top_p", top_p=(0.5, 0.5)), ValueError, r"top_p=\(0.5, 0.5\) lists a p twice"),
        (dict(heads=[np.int64(1)]), TypeError, r"heads must hold Python int indices, got np.int64\(1\) \(int64\)"),
        (dict(colour="red"), TypeError, r"unknown capture option \['colour'\]"),
    ],
)
def test_bad_options_are_one_clear_line(pipe, kwargs, error, match):
    with pytest.raises(error, match=match) as err:
        cogattn.record(pipe, **kwargs)
    assert "\n" not in str(err.value) and _hooks(pipe) == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(height=481), r"height: 481 must be a positive multiple of 16 \(the CogVideoX VAE's 8 × the patch size 2\)"),
        (dict(num_inference_steps=0), r"num_inference_steps: 0 must be at least 1"),
        (dict(num_inference_steps=-1), r"num_inference_steps: -1 must be at least 1"),
        (dict(num_frames=48), r"num_frames: 48; the CogVideoX VAE decodes 4k \+ 1 frames .*: use 45 or 49"),
        (dict(num_frames=49.0), r"num_frames: 49.0 must be a whole number"),
        (dict(num_prompts=0), r"num_prompts: 0 must be a whole number of at least 1"),
        (dict(model="nvidia/Cosmos3-Nano", num_frames=189, height=712, width=1280),
         r"height: 712 must be a positive multiple of 16 \(the Cosmos 3 VAE's 16; the transformer pads to whole"),
    ],
)  # fmt: skip
def test_an_estimate_of_a_call_the_pipeline_refuses_is_one_line(kwargs, match):
    """``estimate`` checks the call's sizes as the batch tool does (before: a plan of -42 records for -1 steps, and
    of a height the pipeline refuses); Cosmos 3's transformer pads its latents to whole patches, so 720 rows plan."""
    call = dict(model="THUDM/CogVideoX-5b", num_frames=49, height=480, width=720, num_inference_steps=50)
    call.update(kwargs)
    with pytest.raises(ValueError, match=match) as err:
        cogattn.estimate(call.pop("model"), kinds=("frame",), **call)
    assert "\n" not in str(err.value)
    est = cogattn.estimate("nvidia/Cosmos3-Nano", kinds=("frame",), num_frames=189, height=720, width=1280,
                           num_inference_steps=2)  # fmt: skip
    assert est.layout.grid == (48, 23, 40) and est.num_records == 2 * 36


def test_an_estimate_takes_a_transformer_s_config_as_it_takes_the_transformer(pipe):
    """``transformer.config`` or a dict of config.json's keys (it was taken for a path: an OSError, name too long)."""
    call = dict(kinds=("frame",), num_frames=9, height=48, width=80, num_inference_steps=2)
    want = cogattn.estimate(pipe, **call)
    for config in (pipe.transformer.config, dict(pipe.transformer.config)):
        got = cogattn.estimate(config, **call)
        assert (got.layout, got.records, got.peak_extra_memory) == (want.layout, want.records, want.peak_extra_memory)


def test_memory_budget_accepts_exponents_in_either_case():
    assert cogattn.CaptureOptions(memory_budget="1E9").memory_budget == 10**9
    assert cogattn.CaptureOptions(memory_budget="1.5e9").memory_budget == 1_500_000_000


def test_save_dir_that_cannot_be_a_folder_is_a_store_error(pipe, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(cogattn.StoreError, match="cannot create the output folder"):
        cogattn.record(pipe, save_dir=tmp_path / "file" / "run")
    assert _hooks(pipe) == 0


def test_save_dir_expands_the_home_folder(pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with cogattn.record(pipe, kinds="frame", save_dir="~/runs/fox"):
        generate(pipe, steps=1, output_type="latent")
    assert cogattn.load("~/runs/fox").complete and not Path("~").exists()


def test_a_refused_run_leaves_no_folder_behind(pipe, tmp_path):
    with pytest.raises(ValueError, match="asks for step 5"):
        with cogattn.record(pipe, steps=[5], save_dir=tmp_path / "new" / "run"):
            generate(pipe, steps=2, output_type="latent")
    assert not (tmp_path / "new").exists()  # nor the parent it made
    (tmp_path / "mine").mkdir()  # a folder the user made stays, empty
    with pytest.raises(ValueError, match="asks for step 5"):
        with cogattn.record(pipe, steps=[5], save_dir=tmp_path / "mine"):
            generate(pipe, steps=2, output_type="latent")
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())


@pytest.mark.parametrize("cause", ["another recording", "processors"])
def test_a_refused_record_call_touches_no_folder(pipe, tmp_path, cause):
    from diffusers.models.attention_processor import AttnProcessor2_0, CogVideoXAttnProcessor2_0

    old = tmp_path / "old"  # a closed run the user keeps: overwrite=True must not replace it when refused
    with cogattn.record(pipe, kinds="frame", save_dir=old, info={"who": "old"}):
        generate(pipe, steps=1, output_type="latent")
    (tmp_path / "empty").mkdir()
    new, empty = tmp_path / "new" / "run", tmp_path / "empty"
    error, match = (ValueError, "close the other recording") if cause == "another recording" else (TypeError, "stock")
    other = cogattn.record(pipe, kinds="frame") if cause == "another recording" else None
    if other is None:
        pipe.transformer.set_attn_processor(AttnProcessor2_0())
    for save_dir, overwrite in ((new, False), (empty, False), (old, True)):
        with pytest.raises(error, match=match):
            cogattn.record(pipe, kinds="frame", save_dir=save_dir, overwrite=overwrite)
    assert not (tmp_path / "new").exists() and not any(empty.iterdir())
    assert cogattn.load(old).info == {"who": "old"} and len(cogattn.load(old)) == 2
    if other is None:
        pipe.transformer.set_attn_processor(CogVideoXAttnProcessor2_0())
    else:
        other.close()
    for save_dir in (new, empty):  # the same folders now take a run
        with cogattn.record(pipe, kinds="frame", save_dir=save_dir):
            generate(pipe, steps=1, output_type="latent")
        assert cogattn.load(save_dir).complete and len(cogattn.load(save_dir)) == 2


def test_a_bare_triple_of_ints_is_no_query_and_a_point_means_the_same_everywhere(pipe):
    from cogattn import plot
    from cogattn.analysis import locate_query

    with pytest.raises(ValueError, match=r"\[2, 1, 4\] for token indices.*\[\(2, 1, 4\)\] for the video point"):
        cogattn.record(pipe, kinds="query", queries=(2, 1, 4))  # tokens 2, 1, 4 or the point (2, 1, 4)?
    assert _hooks(pipe) == 0
    assert cogattn.CaptureOptions(kinds="query", queries=(2, 1)).queries == [2, 1]  # not a point: tokens
    opts = cogattn.CaptureOptions(kinds="query", queries=[2, 1, 4])
    assert cogattn.CaptureOptions.build(opts, topk=3).queries == [2, 1, 4]  # rebuilt, still tokens
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds="query", heads="all", queries=[2, 1, 4]) as tokens:
        generate(pipe, steps=1, output_type="latent")
    spy.remove()
    assert_matches_naive(tokens, spy, [1], "all", kinds=("query",), queries=[2, 1, 4])
    with cogattn.record(pipe, kinds="query", heads="all", queries=[(2, 1, 4)]) as point:
        generate(pipe, steps=1, output_type="latent")
    # tiny layout: T = 8 text tokens, then latent frames of 3 × 5 patches: (2, 1, 4) is token 8 + 30 + 5 + 4
    assert (point.layout.text_len, point.layout.height, point.layout.width) == (8, 3, 5)
    assert locate_query(point, (2, 1, 4)) == ("query", 0, 47)
    plot.query_map(point, (2, 1, 4))  # the tuple is the recorded point in query_map too
    with pytest.raises(ValueError, match=r"query=\[2, 1, 4\].*\(2, 1, 4\) for the video point"):
        plot.query_map(point, [2, 1, 4])


def test_warnings_point_at_the_users_code(pipe):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with cogattn.record(pipe.transformer, steps=[0, 4]):
            generate(pipe, output_type="latent")
    (w,) = [w for w in seen if "were selected but the generation ran" in str(w.message)]
    assert w.filename == __file__


def test_run_json_says_how_many_steps_it_holds(pipe, tmp_path):
    with cogattn.record(pipe, kinds="frame", save_dir=tmp_path):
        generate(pipe, steps=3, output_type="latent")
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["status"] == "finished" and meta["steps"] == 3 and meta["complete"] is True


def test_plot_mistakes_are_one_clear_line(pipe):
    from cogattn import plot
    from cogattn.analysis.words import word_positions

    with cogattn.record(pipe, kinds=("frame", "video_to_text"), info={"prompt": "a red fox, running"}) as rec:
        generate(pipe, steps=1, prompt="a red fox, running", output_type="latent")
    for kwargs, error, match in [
        (dict(limits=(1, 0)), ValueError, r"limits=\(1, 0\): vmin must be below vmax"),
        (dict(limits=(0, 1), scale="log"), ValueError, "a log scale needs a positive vmin"),
        (dict(limits=("a", 1)), TypeError, "must be two finite numbers"),
    ]:
        with pytest.raises(error, match=match) as err:
            plot.frame_heatmap(rec, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(cogattn.NotRecordedError, match="'query'") as err:
        plot.query_map(rec, 0)
    assert "0..-1" not in str(err.value)
    assert word_positions("Fox,", pipe.tokenizer, "a red fox, running", 8) == [2]
    fig = plot.word_heatmap(rec, "Fox,", tokenizer=pipe.tokenizer)
    assert '"Fox," (token 2)' in fig.axes[0].get_ylabel()


@pytest.mark.parametrize(
    "name", ["WanAnimate2Transformer3DModel", "SanaWMTransformer3DModel", "SanaWMLTX2RefinerTransformer3DModel"]
)
def test_a_video_transformer_cogattn_does_not_record_is_refused_saying_why(name, tmp_path):
    """Wan-Animate-2 and SANA-WM (its refiner too): ``record`` on the transformer or its pipeline, and ``estimate``
    of a checkpoint folder, refuse in the one line that says why, not as a class cogattn never heard of."""
    import re

    import diffusers

    from cogattn.models import REFUSED

    cls = getattr(diffusers, name, None)
    if cls is None:
        pytest.skip(f"this diffusers has no {name}")
    module = cls.__new__(cls)  # the class alone names it: no weights are built
    torch.nn.Module.__init__(module)
    why = REFUSED[name]
    assert name in why and "is not recorded: " in why and "\n" not in why
    for target in (module, type("Pipe", (), {"transformer": module})()):
        with pytest.raises(TypeError, match=re.escape(why)):
            cogattn.record(target, kinds=("frame",))
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": name}))
    with pytest.raises(ValueError, match=re.escape(why)):
        cogattn.estimate(str(tmp_path), num_frames=9, height=64, width=64, num_inference_steps=2, kinds=("frame",))
