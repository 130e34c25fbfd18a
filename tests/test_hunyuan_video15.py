"""HunyuanVideo 1.5's own rules: the packed context's mask read as one count per item, the layout of a call
(image tokens only where the call carries an image), each item's spans of image, glyph and prompt tokens and its
word labels against the ids its pipeline's own encoders handed on, those spans kept in run.json and checked when
read back."""

import pytest
import torch

import cogattn
from cogattn.analysis import words

hv15 = cogattn.models.hunyuan_video15
pytestmark = pytest.mark.skipif(hv15 is None, reason="this diffusers lacks HunyuanVideo 1.5")


def test_the_context_mask_is_one_kept_count_per_item_and_anything_but_a_prefix_is_refused():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert hv15.kept_counts(mask, 5 + 18).tolist() == [21, 19, 23]  # the 18 video tokens and the kept context
    assert hv15.kept_counts(torch.ones(2, 5), 23) is None  # everything kept: no counts
    with pytest.raises(ValueError, match="keeps each item's first keys; this one keeps others"):
        hv15.kept_counts(torch.tensor([[1, 0, 1, 0, 0]]), 23)


@pytest.mark.parametrize("image", [None, "zeros", "image"])
def test_a_call_s_layout_counts_image_tokens_only_where_it_carries_an_image(image):
    config = {"patch_size": 1, "patch_size_t": 1}
    kwargs = dict(
        hidden_states=torch.zeros(2, 9, 3, 2, 3),
        timestep=torch.tensor([999.0, 999.0]),
        encoder_hidden_states=torch.zeros(2, 8, 16),
        encoder_hidden_states_2=torch.zeros(2, 16, 8),
    )
    if image is not None:  # text-to-video's pipeline passes zeros, which the model packs into the padding
        kwargs["image_embeds"] = torch.zeros(2, 16, 12) if image == "zeros" else torch.ones(2, 16, 12)
    layout, batch, t, _ = hv15.read_call(config, (), kwargs)
    assert (layout.grid, layout.text_position, batch, t) == ((3, 2, 3), "end", 2, 999.0)
    assert layout.text_len == 8 + 16 + (0 if image is None else 16)
    assert layout.image_len == (16 if image == "image" else 0)


# -- each item's spans and word labels, against the tokens its pipeline's own encoders handed on ---------------
PROMPTS = ["a red fox running", 'a "fox" in the snow']  # item 0 has no glyph tokens, item 1 the bytes of "fox"
NEGATIVES = ["a dog", 'a "cat"']


def _spy_ids(encoder, seen):
    """Keep each call's ``(input_ids, attention_mask)`` of ``encoder`` (its forward runs as it is)."""

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append((ids.clone(), kwargs.get("attention_mask")))

    return encoder.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.fixture(scope="module", params=["text-to-video", "image-to-video"])
def recorded(request, tmp_path_factory):
    """A guided recording of the tiny pipeline over two prompts and their negatives (batch="all", saved), with the
    ids and masks its Qwen2.5-VL and ByT5 encoders received."""
    import PIL.Image

    task = request.param
    pipe, mllm, byt5 = hv15.tiny_pipeline(task), [], []
    hooks = [_spy_ids(pipe.text_encoder, mllm), _spy_ids(pipe.text_encoder_2, byt5)]
    pipe.guider.guidance_scale = 6.0
    call = dict(prompt=PROMPTS, negative_prompt=NEGATIVES, num_frames=9, num_inference_steps=1, output_type="latent")
    if task == "image-to-video":
        call["image"] = PIL.Image.new("RGB", (48, 32), (200, 40, 10))
    else:
        call.update(height=32, width=48)
    folder = tmp_path_factory.mktemp("hv15") / "maps"
    with cogattn.record(pipe, kinds=("video_to_text",), batch="all", save_dir=folder) as rec:
        pipe(**call, generator=torch.Generator().manual_seed(0))
    for hook in hooks:
        hook.remove()
    return task, pipe, rec, folder, mllm, byt5


def _expected(pipe, mllm, byt5, images: int, slot: int, T: int) -> tuple[list[str], dict]:
    """The labels and spans of result slot ``slot`` (``[uncond, uncond, cond, cond]``) from the encoders' own calls:
    the image tokens, the valid ByT5 bytes of its quoted words, the valid Qwen tokens after the crop, the padding."""
    cond, item = slot >= 2, slot % 2
    ids, mask = mllm[0 if cond else 1]  # the prompts are encoded first, then the negatives
    crop = pipe.prompt_template_encode_start_idx
    kept = ids[item, crop:][mask[item, crop:].bool()].tolist()
    texts = PROMPTS if cond else NEGATIVES
    quoted = [i for i, t in enumerate(texts) if '"' in t]  # ByT5 runs once per prompt with a quoted word
    glyph = []
    if item in quoted:
        g_ids, g_mask = byt5[0 if cond else 1]  # the prompts' quoted one first (item 1 of each list has a quote)
        glyph = g_ids[0][g_mask[0].bool()].tolist()
    names = ["<image>"] * images + pipe.tokenizer_2.convert_ids_to_tokens(glyph)
    names += pipe.tokenizer.convert_ids_to_tokens(kept)
    names += [pipe.tokenizer.pad_token] * (T - len(names))
    g, m = len(glyph), len(kept)
    return names, {"image": (0, images), "glyph": (images, images + g), "prompt": (images + g, images + g + m)}


def test_each_item_s_labels_and_spans_are_the_tokens_its_encoders_handed_the_transformer(recorded):
    task, pipe, rec, _, mllm, byt5 = recorded
    images = 16 if task == "image-to-video" else 0
    T = rec.layout.prompt_len
    assert rec.layout.text_parts == (("image", 16), ("glyph", 16), ("prompt", 8)) and rec.layout.prompt_crop == 7
    assert rec.batch_roles == ("uncond", "uncond", "cond", "cond") and len(mllm) == 2 and len(byt5) == 2
    for slot in range(4):
        names, spans = _expected(pipe, mllm, byt5, images, slot, T)
        assert rec.text_spans[slot] == spans
        assert rec.text_lengths[slot] == spans["prompt"][1]  # the processor's mask keeps exactly these
        text = (NEGATIVES if slot < 2 else PROMPTS)[slot % 2]
        assert words.text_tokens(pipe, text, T, spans=words.item_spans(rec, slot)) == names
    assert rec.text_spans[3]["glyph"] != rec.text_spans[2]["glyph"]  # the quoted word moves item 1's prompt on
    labels = words.text_tokens(pipe, PROMPTS[1], T, spans=rec.text_spans[3])
    fox = words.word_positions("fox", pipe, PROMPTS[1], T, spans=rec.text_spans[3])
    assert [labels[i] for i in fox] == ["fox"] and fox[0] >= rec.text_spans[3]["prompt"][0]
    glyph = words.word_positions("fox", pipe, PROMPTS[1], T, spans=rec.text_spans[3], glyph=True)
    assert [labels[i] for i in glyph] == ["f", "o", "x"] and glyph[0] == images + len('Text "')
    assert words.word_positions("fox", pipe, PROMPTS[0], T, spans=rec.text_spans[2]) == [images + 2]
    with pytest.raises(ValueError, match="not a quoted word"):
        words.word_positions("red", pipe, PROMPTS[0], T, spans=rec.text_spans[2], glyph=True)
    negative = words.text_tokens(pipe, NEGATIVES[1], T, spans=words.item_spans(rec, 1))
    assert "cat" in negative and "fox" not in negative  # the unconditional item: the negative prompt's labels


def test_a_run_keeps_each_item_s_spans_and_the_layout_s_parts(recorded):
    _, _, rec, folder, _, _ = recorded
    run = cogattn.load(folder)
    assert run.layout == rec.layout and run.text_spans == rec.text_spans
    assert words.item_spans(run) == rec.text_spans[2] and words.item_spans(run, "uncond") == rec.text_spans[0]


def test_the_released_layout_names_its_parts_and_the_template_crop():
    layout = hv15.layout_for_video(hv15.KNOWN["hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v"], 121, 480, 848, None)
    assert layout.text_parts == (("image", 729), ("glyph", 256), ("prompt", 1000)) and layout.prompt_crop == 108
    assert (layout.seq_len, layout.image_len) == (31 * 30 * 53 + 1985, 729)


# -- run.json's spans and parts are checked when read: a run folder may come from anyone -------------------------
def _hostile(folder, tmp_path, change):
    import json
    import shutil

    copy = shutil.copytree(folder, tmp_path / "maps")
    meta = json.loads((copy / "run.json").read_text())
    change(meta)
    (copy / "run.json").write_text(json.dumps(meta))
    return copy


@pytest.mark.parametrize(
    "field, value",
    [
        ("text_spans", "all"),
        ("text_spans", [{"prompt": [0, 5]}]),  # one slot of four
        ("text_spans[2]", {"prompt": [0, 41]}),  # past the 40 text tokens
        ("text_spans[2]", {"glyph": [0, 13], "prompt": [5, 21]}),  # the prompt inside the glyph tokens
        ("text_spans[2]", {"prompt": [3, 1]}),
        ("text_spans[2]", {"prompt": [0, "5"]}),
        ("text_spans[2]", {"prompt": [0, 5.0]}),
        ("text_spans[2]", {"words": [0, 5]}),
        ("text_spans[2]", []),
    ],
)
def test_hostile_text_spans_are_refused_naming_run_json_and_the_field(recorded, tmp_path, field, value):
    from cogattn.errors import StoreError

    folder = recorded[3]

    def change(meta):
        if field == "text_spans":
            meta["selection"]["text_spans"] = value
        else:
            meta["selection"]["text_spans"][2] = value

    with pytest.raises(StoreError) as err:
        cogattn.load(_hostile(folder, tmp_path, change))
    said = str(err.value)
    assert len(said.splitlines()) == 1 and "run.json" in said and f"selection.{field}" in said


@pytest.mark.parametrize(
    "field, value",
    [
        ("text_parts", [["image", 16], ["glyph", 16], ["prompt", 9]]),  # 41, not text_len
        ("text_parts", [["image", 16], ["glyph", 16], ["words", 8]]),
        ("text_parts", [["image", 16], ["image", 24]]),
        ("text_parts", [["image", -16], ["glyph", 48], ["prompt", 8]]),
        ("text_parts", "image glyph prompt"),
        ("text_parts", [["image", 16, 1]]),
        ("prompt_crop", -1),
        ("prompt_crop", "7"),
    ],
)
def test_hostile_layout_parts_are_refused_and_leave_the_run_out_of_the_viewer(recorded, tmp_path, field, value):
    from cogattn.errors import StoreError
    from cogattn.view.data import open_runs

    folder = _hostile(recorded[3], tmp_path, lambda meta: meta["layout"].update({field: value}))
    with pytest.raises(StoreError) as err:
        cogattn.load(folder)
    said = str(err.value)
    assert len(said.splitlines()) == 1 and "run.json" in said and f"layout.{field}" in said
    problems = []
    with pytest.raises(FileNotFoundError):
        open_runs(folder, problems)
    assert len(problems) == 1 and f"layout.{field}" in problems[0]


def test_the_viewer_names_a_run_s_text_tokens_by_their_parts_without_the_batch_tool_s_labels(recorded):
    from cogattn.view.data import RunView

    task, _, rec, folder, _, _ = recorded
    view = RunView(folder)
    summary = view.summary()
    images = 16 if task == "image-to-video" else 0
    assert summary["text_spans"][3] == {k: list(v) for k, v in rec.text_spans[3].items()}
    tokens, negative = summary["tokens"], summary["negative_tokens"]  # the first conditional item's: slot 2
    assert tokens[:images] == ["image " + str(i) for i in range(images)] and tokens[images] == "prompt 0"
    assert tokens[rec.text_spans[2]["prompt"][1]] == "pad " + str(rec.text_spans[2]["prompt"][1])
    start, end = rec.text_spans[0]["prompt"]  # the unconditional item's (no quoted word: "a dog")
    assert negative[end - 1] == f"prompt {end - 1 - start}" and negative[end] == f"pad {end}"


def test_a_word_map_reads_the_shown_item_s_own_spans(recorded):
    """``word_heatmap`` finds a word at the item it shows: item 1's "fox" after its glyph bytes, item 0's before."""
    from cogattn import plot

    task, pipe, rec, _, _, _ = recorded
    images = 16 if task == "image-to-video" else 0
    shown = {}
    for slot, prompt in ((2, PROMPTS[0]), (3, PROMPTS[1])):
        fig = plot.word_heatmap(rec, ["fox"], None, tokenizer=pipe, prompt=prompt, batch=slot)
        shown[slot] = [ax.get_ylabel().split("\n")[0] for ax in fig.axes if ax.get_ylabel().startswith('"fox"')]
    assert shown == {2: [f'"fox" (token {images + 2})'], 3: [f'"fox" (token {rec.text_spans[3]["prompt"][0] + 2})']}


def test_a_layout_s_parts_sum_to_its_text():
    with pytest.raises(ValueError, match="the parts' sizes sum to text_len=40"):
        cogattn.TokenLayout(text_len=40, frames=1, height=1, width=1, text_parts=(("image", 16), ("prompt", 8)))
