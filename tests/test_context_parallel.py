"""Recording under diffusers' context parallelism: a tiny Wan generation split over 2 gloo processes (Ulysses 2,
ring 2) and 4 (2 × 2), forked from this one. On each rank the maps come from its slice of the tokens; rank 0's must
equal the naive float64 softmax of q and k recomputed from every attention module's inputs on every rank and put
together in the order of the slices (that order proved by P·V against the modules' own outputs), the output with
recording on must equal the same CP run's without, and only rank 0 writes a run.

diffusers' CP runs on a CPU under two test-only shims, which touch diffusers, not cogattn (``cp_shims.py``)."""

import json
import multiprocessing
import os
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers.models.transformers.transformer_wan")

import forked
from cp_shims import enable as _enable
from cp_shims import shims as _shims
from test_wan import WanSpy, assert_matches_spy

import cogattn
from cogattn.errors import StoreError
from cogattn.models.wan import tiny_pipeline

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

HEIGHT, WIDTH = 32, 64  # 3 latent frames × 2 × 4 patches = 24 tokens: slices of 12 or 6
SIZES = dict(block_size=7, topk=5)  # test_wan's reference sizes
CALL = dict(num_frames=9, height=HEIGHT, width=WIDTH, num_inference_steps=2, guidance_scale=5.0, output_type="latent")


class Outputs:
    """Each ``attn1`` call's output and values, as the module formed them on this rank (for the P·V proof)."""

    def __init__(self, transformer):
        self.calls = []
        self._handles = [
            b.attn1.register_forward_hook(self._hook(i), with_kwargs=True) for i, b in enumerate(transformer.blocks)
        ]

    def _hook(self, layer):
        def hook(attn, args, kwargs, output):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            v = attn.to_v(hs).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            self.calls.append((layer, v.detach().clone(), output.detach().clone()))

        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's ``x`` joined along ``dim`` in rank order (the order of diffusers' slices)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def _ranks(target, world: int, tmp_path, *args) -> None:
    """``target(rank, world, *args)`` in ``world`` processes forked from this one and joined by gloo, under the
    shims; fails with what any of them raised."""
    errors = forked._FORK.Queue()
    init = tmp_path / f"init-{len(list(tmp_path.glob('init-*')))}"
    procs = [forked.start(_guarded, target, r, world, init, args, errors) for r in range(world)]
    for p in procs:
        p.join(120)
        if p.is_alive():  # a rank that raised leaves the others waiting in a collective
            p.kill()
    reported = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not reported, "\n".join(reported)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _guarded(target, rank, world, init, args, errors):
    import traceback

    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        _shims()
        target(rank, world, *args)
        dist.barrier()
    except BaseException as err:  # reported to the test, which fails with it
        errors.put(f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank(rank, world, ring, ulysses, out, pipe, kinds, heads):
    """One rank of the tiny Wan pipeline under the mesh: the stock CP run and the recorded one (recording started
    before ``enable_parallelism`` on the 2 × 2 mesh), then rank 0's maps against the reference of every rank's q and k
    joined in slice order, proved by P·V."""
    run = dict(kinds=kinds, heads=heads, batch="all", save_dir=out / f"run{rank}", **SIZES)
    if ring * ulysses == 4:  # the 2 × 2 mesh: recording starts before enable_parallelism
        spy, outputs, rec = WanSpy(pipe), Outputs(pipe.transformer), cogattn.record(pipe, **run)
        _enable(pipe.transformer, ring, ulysses)
        with rec:
            got = pipe(**CALL, **_prompt()).frames
        spy.__exit__(), outputs.remove()
        stock = pipe(**CALL, **_prompt()).frames
    else:
        _enable(pipe.transformer, ring, ulysses)
        stock = pipe(**CALL, **_prompt()).frames
        spy, outputs = WanSpy(pipe), Outputs(pipe.transformer)
        with cogattn.record(pipe, **run) as rec:
            got = pipe(**CALL, **_prompt()).frames
        spy.__exit__(), outputs.remove()
    assert torch.equal(got, stock), "recording changed the CP run's output"
    assert (rec.mesh.ring, rec.mesh.ulysses, rec.mesh.rank) == (ring, ulysses, dist.get_rank())
    # the full sequence's q and keys of every call: self-attention q and k and cross-attention q are sliced
    spy.calls = [
        (e, layer, role, _gather(q, 2), {n: (_gather(k, 2) if n == "self" else k) for n, k in keys.items()})
        for e, layer, role, q, keys in spy.calls
    ]
    proofs = [(layer, _gather(v, 2), _gather(o, 1)) for layer, v, o in outputs.calls]
    if rank == 0:
        selfs = [c for c in spy.calls if c[2] == "self"]
        for (_, layer, _, q, keys), (layer_o, v, o) in zip(selfs, proofs):  # the reference's P·V is the output
            assert layer == layer_o
            P = torch.softmax(q.double() @ keys["self"].double().transpose(-1, -2) / q.shape[-1] ** 0.5, -1)
            attn = pipe.transformer.blocks[layer].attn1
            ref = attn.to_out[0]((P @ v.double()).transpose(1, 2).flatten(2).float())
            assert (ref - o).abs().max() <= 1e-5 * max(1.0, o.abs().max().item())
        assert_matches_spy(rec, spy, kinds, [0, 1], heads, 2)
        meta = json.loads((out / "run0" / "run.json").read_text())
        assert meta["mesh"] == {"ring": ring, "ulysses": ulysses, "ranks": ring * ulysses}
        assert cogattn.load(out / "run0").keys() == rec.keys()
    else:
        assert rec.keys() == [] and not (out / f"run{rank}").exists()
        with pytest.raises(RuntimeError, match="rank 0 holds the results"):
            rec.get(kinds[0], 0, 0)
    if ring > 1:  # the opt-in output calls bypass the CP dispatch: refused, before any block runs
        with pytest.raises(ValueError, match="context-parallel dispatch"):
            with cogattn.record(pipe, kinds=("frame",), layer_output="lse"):
                pipe(**CALL, **_prompt())


def _prompt():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(1, 512, 16, generator=g)
    return dict(prompt_embeds=emb, negative_prompt_embeds=-emb, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "ring,ulysses,kinds,heads",
    [
        (1, 2, ("frame", "video_to_text", "entropy", "received", "block", "topk"), "all"),
        (2, 1, ("frame", "video_to_text", "query_frame", "offset", "tile", "full"), [3, 0, 2]),
        (2, 2, ("frame", "video_to_text", "topk", "entropy", "received"), "mean"),
    ],
    ids=["ulysses2", "ring2", "unified2x2-mean"],
)
def test_maps_under_context_parallelism_match_the_reference(tmp_path, ring, ulysses, kinds, heads):
    pipe = tiny_pipeline(num_heads=4)  # made once here: the forked ranks share its weights
    _ranks(_rank, ring * ulysses, tmp_path, ring, ulysses, tmp_path, pipe, kinds, heads)
    assert os.path.exists(tmp_path / "run0" / "run.json")


def _family_rank(rank, world, pipe, call, kinds):
    """One rank of a family's tiny pipeline under Ulysses 2: its maps without CP first (the family's conformance tests
    hold those to the naive reference), then under CP, whose attention is then the same bit for bit, where rank 0's
    must equal them."""
    run = dict(kinds=kinds, batch="all", heads="all", **FAMILY_SIZES)
    with cogattn.record(pipe, **run) as single:
        pipe(**call(), output_type="latent")
    _enable(pipe.transformer, 1, 2)
    stock = pipe(**call(), output_type="latent").frames
    with cogattn.record(pipe, **run) as rec:
        got = pipe(**call(), output_type="latent").frames
    assert torch.equal(got, stock), "recording changed the CP run's output"
    if rank == 0:
        assert rec.keys() == single.keys() and rec.keys()
        for key in rec.keys():  # topk and frame_max: values, then indices
            a, b = rec.get(*key), single.get(*key)
            for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                assert x.shape == y.shape and (x.double() - y.double()).abs().max() <= 1e-5, key
    else:
        assert rec.keys() == []


FAMILY_SIZES = dict(block_size=7, topk=4, queries=[0, (1, 1, 2)], patterns=("spatial", "temporal", "window:1"))


def _families_case(name):
    from test_families import CASES, FAMILY

    case = CASES[name]
    pipe = FAMILY[name].tiny_pipeline(num_heads=4)  # Ulysses deals the heads out
    spec = cogattn.models.spec_for_module(pipe.transformer)
    kinds = tuple(k for k in spec.kinds() if k not in case.skip)

    def call():
        g = torch.Generator().manual_seed(0)
        return {**case.call(pipe, g, True), "generator": torch.Generator().manual_seed(1), "num_inference_steps": 2}

    return pipe, kinds, call


def test_chronoedit_records_under_ulysses(tmp_path):
    """ChronoEdit, Wan's attention in another transformer with its own plan: every kind (the pattern kinds too, whose
    error folds the exchanged values) under Ulysses 2 equals the same call's maps without CP, and the output with
    recording on the CP run's without."""
    pipe, kinds, call = _families_case("chronoedit")
    _ranks(_family_rank, 2, tmp_path, pipe, call, kinds)


def _alone_rank(rank, world, out, pipe):
    """What one rank alone meets under Ulysses 2, raised on both ranks at one point of the generation (else the other
    waits in the next collective): rank 1's plan refused (by its host's memory, say); rank 0's save_dir not empty at
    the first call, a record it cannot write (the generation stops after that call), its run that cannot be closed."""
    from cogattn.recorder import recording
    from cogattn.runs.store import RunWriter

    _enable(pipe.transformer, 1, 2)
    run = dict(kinds=("frame", "entropy"), batch="all")
    plan = recording.plan_capture

    def refused_on_rank_1(*args, **kwargs):
        if rank == 1:
            raise ValueError("no room on this host (a test)")
        return plan(*args, **kwargs)

    recording.plan_capture = refused_on_rank_1
    try:
        expected = (
            (ValueError, "no room") if rank == 1 else (RuntimeError, "rank 1 of the context-parallel mesh could not "
                                                       "start the run, so this rank stops too: ValueError: no room")
        )  # fmt: skip
        with pytest.raises(expected[0], match=expected[1]):
            with cogattn.record(pipe, save_dir=out / "plan", **run):
                pipe(**CALL, **_prompt())
    finally:
        recording.plan_capture = plan
    assert rank == 1 or not (out / "plan").exists()  # rank 0's run, refused before any record: discarded
    rank1 = "rank 0 of the context-parallel mesh could not {}, so this rank stops too: StoreError: "
    if rank == 0:  # (rank 1's save_dir is not looked at: it writes nothing)
        (out / "full").mkdir()
        (out / "full" / "notes.txt").write_text("mine")
    dist.barrier()
    expected = (StoreError, "is not empty") if rank == 0 else (RuntimeError, rank1.format("start the run"))
    with pytest.raises(expected[0], match=expected[1]):
        with cogattn.record(pipe, save_dir=out / "full", **run):
            pipe(**CALL, **_prompt())
    calls, put = [], RunWriter.put

    def failing_put(self, *args):  # the third record fails (step 0's second layer)
        calls.append(args)
        if len(calls) == 3:
            raise StoreError("the disk is full (a test)")
        return put(self, *args)

    RunWriter.put = failing_put
    try:
        expected = (
            (StoreError, "the disk is full")
            if rank == 0
            else (RuntimeError, rank1.format("capture or write this call"))
        )
        with pytest.raises(expected[0], match=expected[1]):
            with cogattn.record(pipe, save_dir=out / "put", **run) as rec:
                pipe(**CALL, **_prompt())
        assert rec.timesteps == rec.timesteps[:1] and rec.status == "failed"  # stopped after the step-0 call
        assert len(calls) == (4 if rank == 0 else 0)  # step 0: 2 layers × 2 kinds, all tried
    finally:
        RunWriter.put = put
    from cogattn.recorder.capture import Capture

    outs, seen = Capture._outs, []

    def out_of_memory_on_rank_1(
        self, *args
    ):  # rank 1's own memory, at step 1's first capture (2 calls × 2 layers a step)
        seen.append(1)
        if rank == 1 and len(seen) == 5:
            raise torch.OutOfMemoryError("out of memory (a test)")
        return outs(self, *args)

    Capture._outs = out_of_memory_on_rank_1
    try:
        expected = (
            (torch.OutOfMemoryError, "a test") if rank == 1 else (RuntimeError, "rank 1 of the context-parallel mesh "
             "could not capture or write this call, so this rank stops too: OutOfMemoryError: out of memory")
        )  # fmt: skip
        with pytest.raises(expected[0], match=expected[1]):
            with cogattn.record(pipe, save_dir=out / "memory", **run) as rec:
                pipe(**CALL, **_prompt())
        assert len(rec.timesteps) == 2 and rec.status == "failed"  # stopped after step 1's first call
    finally:
        Capture._outs = outs
    if rank == 0:  # step 0's records, none of step 1's
        assert cogattn.load(out / "memory").keys() == [(k, 0, i) for k in ("entropy", "frame") for i in (0, 1)]
    close = RunWriter.close

    def failing_close(self, meta=None):
        close(self, meta)
        raise StoreError("run.json could not be written (a test)")

    RunWriter.close = failing_close
    try:
        expected = (
            (StoreError, "run.json could not") if rank == 0 else (RuntimeError, rank1.format("finish writing the run"))
        )
        with pytest.raises(expected[0], match=expected[1]):
            with cogattn.record(pipe, save_dir=out / "close", **run):
                pipe(**CALL, **_prompt())
    finally:
        RunWriter.close = close
    with warnings.catch_warnings(record=True) as said:  # and the mesh goes on together
        warnings.simplefilter("always")
        with cogattn.record(pipe, save_dir=out / "fine", **run) as rec:
            pipe(**CALL, **_prompt())
    assert rec.status == "finished" and len(rec.timesteps) == 2
    assert not [w for w in said if "did not run" in str(w.message)]  # rank 1 stores nothing: no call was skipped


def test_what_one_rank_alone_meets_is_raised_on_every_rank(tmp_path):
    _ranks(_alone_rank, 2, tmp_path, tmp_path, tiny_pipeline(num_heads=4))
    assert cogattn.load(tmp_path / "fine").keys() == [
        (k, s, i) for k in ("entropy", "frame") for s in (0, 1) for i in (0, 1)
    ]


def _refused_rank(rank, world, pipe, call):
    _enable(pipe.transformer, 2, 1)
    with pytest.raises(ValueError, match="does not record ltx_video under context parallelism yet"):
        with cogattn.record(pipe, kinds=("frame",)):
            pipe(**call(), output_type="latent")


def test_a_family_not_checked_under_context_parallelism_is_refused_in_one_line(tmp_path):
    pipe, _, call = _families_case("ltx_video")
    _ranks(_refused_rank, 2, tmp_path, pipe, call)


def test_estimate_plans_each_rank_of_a_mesh():
    """``estimate(parallel=...)``: each rank's heads, what it holds of the exchange (q and k of every token of its
    heads, and the slice's buffers: as much again), counted in its budget; the refusals a recording makes."""
    call = dict(num_frames=81, height=720, width=1280, num_inference_steps=50, guidance_scale=5.0, dtype="bfloat16")
    est = cogattn.estimate(
        "Wan-AI/Wan2.1-T2V-14B-Diffusers", kinds=("frame",), heads=list(range(9)), batch="cond",
        parallel={"ring": 2, "ulysses": 2}, device="cuda", **call,
    )  # fmt: skip
    S = 21 * 45 * 80
    share = est.parallel
    assert (share.ring, share.ulysses, share.heads) == (2, 2, 3)  # 9 heads over 4 ranks: parts of 3, 2, 2, 2
    assert share.exchange_bytes == 2 * 2 * 3 * S * 128 * 2  # q and k, bf16, and the buffers they cross in
    assert share.calls == 40 * 50  # every layer of the conditional call of each step
    # the predicted peak holds the exchange and the tiles planned in the budget less it
    assert est.peak_extra_memory == est.plan.peak_extra_memory + share.exchange_bytes
    assert est.peak_extra_memory <= 2**30 < est.peak_extra_memory + share.exchange_bytes
    assert f"predicted peak extra memory: {est.peak_extra_memory:,} bytes" in est.table()
    assert "ring 2 × ulysses 2 (4 ranks): at most 3 heads a rank" in est.table()
    assert share.moved_bytes == 2 * 3 * 3 * (S // 4) * 128 * 2  # q and k of its 3 heads' slice to the 3 others
    # topk with heads="mean" (the head-mean row): every head on rank 0, each rank's buffers padded to all 40; the
    # values too for pattern_error; frame's exchange of 10 heads a rank, sent as well
    est = cogattn.estimate(
        "Wan-AI/Wan2.1-T2V-14B-Diffusers", kinds=("frame", "topk", "pattern_error"), heads="mean", batch="cond", patterns=("spatial",),
        parallel={"ring": 2, "ulysses": 2}, device="cuda", memory_budget=2**34, **call,
    )  # fmt: skip
    assert est.parallel.heads == 40 and est.parallel.exchange_bytes == 3 * 40 * S * 128 * 2 * 2
    assert est.parallel.moved_bytes == 3 * 3 * (S // 4) * 128 * 2 * (10 + 40)
    with pytest.raises(ValueError, match="does not record cogvideox under context parallelism"):
        cogattn.estimate("THUDM/CogVideoX-5b", num_frames=49, height=480, width=720, num_inference_steps=50,
                         parallel={"ulysses": 2})  # fmt: skip
    with pytest.raises(ValueError, match="4,524 tokens does not split evenly over 8 ranks"):
        cogattn.estimate("Wan-AI/Wan2.1-T2V-14B-Diffusers", **{**call, "height": 464, "width": 832, "num_frames": 9},
                         parallel={"ring": 8})  # 3 × 29 × 52 tokens  # fmt: skip
    with pytest.raises(ValueError, match="holds less than a rank's exchange of q and k .* \\(1,548,288,000 bytes\\)"):
        cogattn.estimate("Wan-AI/Wan2.1-T2V-14B-Diffusers", parallel={"ulysses": 2}, **call)  # 20 heads a rank


def _batch_rank(rank, port, argv, out, codes, hold=False):
    """One process of ``torchrun``, as accelerate reads it from the environment, running the batch tool twice (the
    second run must skip every prompt the first completed); puts each run's exit code and prompt.json times. With
    ``hold``, the first process's first run finds the first prompt's folder locked, as by another batch run."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    _shims()
    torch.accelerator.device_count = lambda: 1  # the first shim, for the whole run (enable_parallelism is inside)
    try:
        from cogattn.dump.cli import main
        from cogattn.dump.config import load_config
        from cogattn.dump.prompts import read_prompts
        from cogattn.runs.folder import RunLock

        held = None
        if hold and rank == 0:
            first = out / read_prompts(load_config(argv[0], [a for a in argv[2::2]]))[0].key()
            first.mkdir(parents=True)
            held = RunLock(first)  # another open file of the lock: this process's own run cannot take it
        for _ in range(2):
            code = main(argv)
            held = held and held.release()
            dist.barrier()  # the first process has written before either looks again
            codes.put((rank, code, {str(p): p.stat().st_mtime_ns for p in out.glob("*/prompt.json")}))
    except BaseException as err:  # reported to the test, which fails with it
        codes.put((rank, f"{type(err).__name__}: {err}", {}))


SPAWN = multiprocessing.get_context("spawn")


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_the_batch_tool_splits_each_generation_over_a_mesh(tmp_path):
    """``parallel: {ulysses: 2}`` under two processes: every prompt generated by both, written once, by the mesh's
    first process (its maps a run whose run.json names the mesh); a second run skips what the first completed.
    The first prompt's folder is locked by another run at first: the mesh's first process cannot take it, so no process
    generates it (before, the other process generated it while the first went on to the next prompt: their collectives
    paired two prompts, whose maps were written complete and wrong, or hung); the next prompt is generated together,
    and the second run does the first."""
    from cogattn.dump.config import default_config

    port, out = _free_port(), tmp_path / "out"
    argv = [
        str(default_config().parent / "tiny-wan.yaml"), "--set", f"save_dir={out}", "--set", "device=cpu",
        "--set", "parallel={ulysses: 2}", "--set", "previews=false", "--set", "capture.batch=all",
    ]  # fmt: skip
    codes = SPAWN.Queue()  # new interpreters: a fork would inherit what earlier tests left in this process
    procs = [SPAWN.Process(target=_batch_rank, args=(r, port, argv, out, codes, True)) for r in range(2)]
    for p in procs:
        p.start()
    got = [codes.get(timeout=300) for _ in range(4)]
    for p in procs:
        p.join(60)
    assert sorted((rank, code) for rank, code, _ in got) == [(0, 0), (0, 1), (1, 0), (1, 1)], got
    first, second = [times for rank, _, times in got if rank == 0]
    assert len(first) == 1 and len(second) == 2 and set(first.items()) < set(second.items())  # the other kept
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(folders) == 2  # the two prompts of prompts/tiny_wan.txt
    for folder in folders:
        meta = json.loads((folder / "prompt.json").read_text())
        assert meta["complete"] and meta["process"] == 0
        run = json.loads((folder / "maps" / "run.json").read_text())
        assert run["mesh"] == {"ring": 1, "ulysses": 2, "ranks": 2} and run["complete"]
        assert cogattn.load(folder / "maps").keys()


def test_the_batch_tool_s_dry_run_plans_a_rank_of_the_mesh_and_refuses_what_cp_cannot(capsys):
    from cogattn.dump.cli import main
    from cogattn.dump.config import default_config

    config = str(default_config().parent / "tiny-wan.yaml")
    assert main([config, "--dry-run", "--set", "parallel={ring: 2}"]) == 0
    assert "context parallel: ring 2 × ulysses 1 (2 ranks): at most 1 heads a rank" in capsys.readouterr().out
    for bad, why in [
        ("parallel={ring: 0}", "parallel.ring: expected a positive integer, got 0."),
        ("parallel={rings: 2}", "parallel: expected a mapping of ring and ulysses degrees"),
        ("capture.layer_output=lse", "parallel: capture.layer_output='lse' is refused"),
    ]:
        extra = [] if bad.startswith("parallel") else ["--set", "parallel={ulysses: 2}"]
        assert main([config, "--dry-run", "--set", bad, *extra]) == 2
        assert why in capsys.readouterr().err
    assert main([str(default_config()), "--dry-run", "--set", "parallel={ulysses: 2}"]) == 2  # CogVideoX: no plan
    assert "does not record cogvideox under context parallelism" in capsys.readouterr().err
