"""Word labels name the tokens the transformer's text really holds: for the tiny pipeline of every family,
the labels of ``cogattn.analysis.words`` (and the batch tool's ``prompt.json`` ``tokens``) are the tokens of the
ids the pipeline's own ``encode_prompt`` hands on, read back through a text encoder that returns its
input ids as its hidden states. Where a family wraps the prompt (HunyuanVideo's LLaMA template and crop,
EasyAnimate's Qwen2-VL chat template), the tiny pipeline gets a tokenizer built to the real one's
structure: a BOS token, the template's special tokens, a word split in two pieces, so that the released
templates' ``crop_start`` (95, 103) counts exactly the tokens before the prompt."""

import inspect
import json
import re
from types import SimpleNamespace

import pytest
import torch

import cogattn.models
from cogattn.analysis import words
from cogattn.layout import TokenLayout

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "a red fox running in the snow"
hv = cogattn.models.hunyuan_video
needs_hunyuan = pytest.mark.skipif(hv is None, reason="this diffusers has no HunyuanVideo")
# Qwen2-VL's chat template, less its image and video parts
QWEN_CHAT = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% for content in message['content'] %}{{ content['text'] }}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(texts, specials, bos: bool):
    """A WordPiece tokenizer of the words of ``texts`` (LLaMA's structure: a BOS token, ``\\n\\n`` a token,
    "behaviors" two pieces), padded on the right."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pattern = r"\n+|\w+|[^\w\s]+"
    found = {w for t in texts for w in re.findall(pattern, re.sub(r"<[|\w]+>", " ", t))} - {"behaviors"}
    vocab = ["<pad>", "<s>", "<unk>", *specials, "behavior", "##s", *sorted(found)]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>")
    out.add_special_tokens({"additional_special_tokens": list(specials)})
    return out


def _llama(pipe):
    """A LLaMA-structured tokenizer for a HunyuanVideo pipeline's default template."""
    template = inspect.signature(pipe.__call__).parameters["prompt_template"].default
    specials = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<image>"]
    return _tokenizer([template["template"], PROMPT], specials, bos=True)


def _qwen():
    texts = ["system\nYou are a helpful assistant.\nuser\nassistant\n", PROMPT]
    tok = _tokenizer(texts, ["<|im_start|>", "<|im_end|>"], bos=False)
    tok.chat_template = QWEN_CHAT
    return tok


class _Out(tuple):
    """A text encoder's output read every way a pipeline reads it ([0], .last_hidden_state, .hidden_states,
    ["hidden_states"])."""

    def __getitem__(self, key):
        return getattr(self, key) if isinstance(key, str) else super().__getitem__(key)


def _spy(encoder, seen):
    """Make ``encoder`` return its input ids as hidden states (channel 0; the ids it saw go in ``seen``)."""

    def forward(input_ids=None, *args, **kwargs):
        seen.append(input_ids)
        h = input_ids[..., None].to(torch.float32).expand(*input_ids.shape, 4).clone()
        out = _Out((h,))
        out.last_hidden_state, out.hidden_states = h, (h,) * 4
        return out

    encoder.forward = forward


def _transformer_ids(pipe, seen, **kwargs):
    """The token ids of the text the transformer gets: the pipeline's prompt_embeds, channel 0."""
    params = inspect.signature(pipe.encode_prompt).parameters
    if "do_classifier_free_guidance" in params:
        kwargs["do_classifier_free_guidance"] = False
    if "complex_human_instruction" in params:  # SANA-Video: the template its call passes by default
        kwargs["complex_human_instruction"] = (
            inspect.signature(pipe.__call__).parameters["complex_human_instruction"].default
        )
    with torch.no_grad():
        emb = pipe.encode_prompt(prompt=PROMPT, **kwargs)[0]
    assert seen, "the text encoder was not called"
    return emb[0, :, 0].round().long().tolist()


def _tiny(spec):
    pipe = spec.tiny_pipeline(spec.tiny_tasks[0])
    if spec.family in ("hunyuan_video", "hunyuan_video_framepack"):
        pipe.tokenizer = _llama(pipe)
    elif spec.family == "easyanimate":
        pipe.tokenizer = _qwen()
    return pipe


@pytest.mark.parametrize("spec", cogattn.models.FAMILIES, ids=lambda s: s.family)
def test_labels_are_the_tokens_of_the_transformer_s_text(spec):
    if spec.family == "minimax_h3":  # a modular pipeline, its Qwen3-VL conditioner read at hidden_states[50]
        pytest.skip("MiniMax-H3's modular pipeline has no encode_prompt; tests/test_cli_families.py checks its labels")
    if spec.family == "cosmos3":  # no text encoder: the transformer reads the token ids
        pytest.skip("Cosmos 3's pipeline has no text encoder; tests/test_cosmos3.py checks its labels")
    pipe, seen = _tiny(spec), []
    _spy(pipe.text_encoder, seen)
    takes_length = "max_sequence_length" in inspect.signature(pipe.encode_prompt).parameters
    length = {"max_sequence_length": 24} if takes_length else {}
    ids = _transformer_ids(pipe, seen, **length)
    T = len(ids)
    if spec.family == "ltx2":  # Gemma pads on the left; the connectors' registers move the valid tokens first
        pad = pipe.tokenizer.pad_token_id
        ids = [i for i in ids if i != pad] + [i for i in ids if i == pad]
        assert ids[0] != pad and ids[-1] == pad  # a prompt shorter than T: the reordering shows
    labels = words.text_tokens(pipe, PROMPT, T)
    assert labels == pipe.tokenizer.convert_ids_to_tokens(ids)
    fox = labels.index("fox")
    assert words.word_positions("fox", pipe, PROMPT, T) == [fox]
    assert words.word_positions("red fox", pipe, PROMPT, T) == [fox - 1, fox]


@needs_hunyuan
def test_hunyuan_video_labels_skip_the_cropped_template_and_its_bos():
    pipe, seen = hv.tiny_pipeline(), []
    pipe.tokenizer = _llama(pipe)
    _spy(pipe.text_encoder, seen)
    ids = _transformer_ids(pipe, seen, max_sequence_length=16)  # the default template, crop_start 95
    assert len(seen[0][0]) == 95 + 16 and pipe.tokenizer.convert_ids_to_tokens(seen[0][0].tolist())[0] == "<s>"
    names = words.text_tokens(pipe, PROMPT, 16)
    assert names[:8] == ["a", "red", "fox", "running", "in", "the", "snow", "<|eot_id|>"]
    assert names == pipe.tokenizer.convert_ids_to_tokens(ids)
    assert words.word_positions("fox", pipe, PROMPT, 16) == [2]
    assert words.text_tokens(pipe.tokenizer, PROMPT, 16)[:3] == ["<s>", "a", "red"]  # the bare prompt: one off
    with pytest.raises(ValueError, match="word 'camera' is not among"):  # a word of the template, not the prompt
        words.word_positions("camera", pipe, PROMPT, 16)
    # a call's own template: crop_start left out, the pipeline counts it (the template's tokens less 2)
    own = {"template": "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video:<|eot_id|>"
           "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"}  # fmt: skip
    seen.clear()
    ids = _transformer_ids(pipe, seen, max_sequence_length=16, prompt_template=own)
    fmt = words.PromptFormat(pipe, own)
    assert words.text_tokens(fmt, PROMPT, 16) == pipe.tokenizer.convert_ids_to_tokens(ids)
    assert words.word_positions("fox", fmt, PROMPT, 16) == [ids.index(pipe.tokenizer.convert_tokens_to_ids("fox"))]


@needs_hunyuan
@pytest.mark.parametrize("length", [16, 9])  # 9: the prompt cuts the assistant header off
def test_hunyuan_video_image_to_video_labels_follow_the_image_tokens(length):
    import PIL.Image

    if not hasattr(__import__("diffusers"), "HunyuanVideoImageToVideoPipeline"):
        pytest.skip("this diffusers has no HunyuanVideo image-to-video")
    pipe, seen = hv.tiny_pipeline("image-to-video"), []
    pipe.tokenizer = _llama(pipe)
    pipe.text_encoder.config.image_token_index = pipe.tokenizer.convert_tokens_to_ids("<image>")
    _spy(pipe.text_encoder, seen)
    image = PIL.Image.new("RGB", (48, 32))
    ids = _transformer_ids(pipe, seen, image=image, max_sequence_length=length, image_embed_interleave=4)
    n = 144  # of the default template's 576 LLaVA tokens, every 4th
    assert len(ids) == n + length - 4 and set(ids[:n]) == {pipe.text_encoder.config.image_token_index}
    names = words.text_tokens(pipe, PROMPT, len(ids), prompt_start=n)
    assert names[:n] == [words.IMAGE_TOKEN] * n and names[n:] == pipe.tokenizer.convert_ids_to_tokens(ids[n:])
    assert names[n : n + 3] == ["a", "red", "fox"]
    assert words.word_positions("fox", pipe, PROMPT, len(ids), prompt_start=n) == [n + 2]
    if length == 16:  # <|eot_id|> and the assistant header are cropped, the "\n\n" after them kept
        assert names[n + 7 : n + 9] == ["\n\n", "<pad>"]


@needs_hunyuan
def test_the_tiny_image_to_video_template_of_a_call_is_followed():
    import PIL.Image

    if not hasattr(__import__("diffusers"), "HunyuanVideoImageToVideoPipeline"):
        pytest.skip("this diffusers has no HunyuanVideo image-to-video")
    pipe, seen = hv.tiny_pipeline("image-to-video"), []
    _spy(pipe.text_encoder, seen)
    image = PIL.Image.new("RGB", (48, 32))
    call = dict(prompt_template=hv.TINY_I2V_TEMPLATE, max_sequence_length=12, image_embed_interleave=4)
    ids = _transformer_ids(pipe, seen, image=image, **call)
    fmt, n = words.PromptFormat(pipe, hv.TINY_I2V_TEMPLATE), 4  # of the tiny LLaVA's 16, every 4th
    names = words.text_tokens(fmt, PROMPT, len(ids), prompt_start=n)
    assert names[n:] == pipe.tokenizer.convert_ids_to_tokens(ids[n:]) and names[n : n + 3] == ["a", "red", "fox"]
    assert words.word_positions("fox", fmt, PROMPT, len(ids), prompt_start=n) == [n + 2]


def test_easyanimate_labels_hold_the_chat_template_s_role_tokens():
    from cogattn.models import easyanimate

    pipe, seen = easyanimate.tiny_pipeline(), []
    pipe.tokenizer = _qwen()
    _spy(pipe.text_encoder, seen)
    ids = _transformer_ids(pipe, seen)
    names = words.text_tokens(pipe, PROMPT, 256)
    assert names == pipe.tokenizer.convert_ids_to_tokens(ids) and len(ids) == 256
    assert names[:5] == ["<|im_start|>", "system", "\n", "You", "are"]
    assert words.word_positions("fox", pipe, PROMPT, 256) == [16]  # after 14 tokens of the template
    assert words.word_positions("fox", pipe.tokenizer, PROMPT, 256) == [2]  # the bare prompt: where it is not
    with pytest.raises(ValueError, match="word 'helpful' is not among"):
        words.word_positions("helpful", pipe, PROMPT, 256)


@pytest.mark.parametrize("family", ["easyanimate", "hunyuan_video"])
def test_a_word_map_is_the_map_at_the_word_s_token_and_a_bare_tokenizer_is_refused(family):
    """Recorded through the pipeline with a prompt: ``word_heatmap(..., tokenizer=pipe)`` draws, under "fox", the
    recorded ``video_to_text`` at the position the transformer's text holds "fox" (after EasyAnimate's 14 tokens of
    chat template, or where HunyuanVideo's cropped template puts it); the tokenizer alone, whose bare prompt puts
    "fox" elsewhere, is refused in one line that says to pass ``pipe``."""
    from cogattn import plot
    from cogattn.plot.style import MAP_GID

    spec = next((s for s in cogattn.models.FAMILIES if s.family == family), None)
    if spec is None:
        pytest.skip(f"this diffusers lacks {family}")
    pipe = _tiny(spec)
    pipe.text_encoder.resize_token_embeddings(len(pipe.tokenizer))  # the test tokenizer's ids are all embedded
    pipe.set_progress_bar_config(disable=True)
    length = {"max_sequence_length": 32} if family == "hunyuan_video" else {}
    with cogattn.record(pipe, kinds=("video_to_text",), heads="all") as rec:
        pipe(prompt=PROMPT, num_frames=9, height=32, width=48, num_inference_steps=1, guidance_scale=1.0,
             output_type="latent", **length)  # fmt: skip
    T = rec.layout.prompt_len
    (fox,) = words.word_positions("fox", pipe, PROMPT, T)
    assert words.text_tokens(pipe, PROMPT, T)[fox] == "fox"
    assert words.word_positions("fox", pipe.tokenizer, PROMPT, T) != [fox]  # the bare prompt's: another token
    with pytest.raises(ValueError, match=r"reads the bare prompt, but .* pass the pipeline, tokenizer=pipe") as err:
        plot.word_heatmap(rec, ["fox"], tokenizer=pipe.tokenizer, prompt=PROMPT)
    assert "\n" not in str(err.value)
    fig = plot.word_heatmap(rec, ["fox"], tokenizer=pipe, prompt=PROMPT)
    panels = [im.get_array() for ax in fig.axes for im in ax.get_images() if im.get_gid() == MAP_GID]
    layers = range(len(rec.layer_names))
    want = torch.stack([rec.get("video_to_text", 0, layer)[0, :, fox] for layer in layers]).double().mean((0, 1))
    assert len(panels) == rec.layout.frames and f'"fox" (token {fox})' in fig.axes[0].get_ylabel()
    for f, got in enumerate(panels):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want[f], rtol=0, atol=1e-6)


def test_wan_labels_are_of_the_prompt_its_pipeline_cleans():
    from cogattn.models import wan

    pipe, seen = wan.tiny_pipeline(), []
    _spy(pipe.text_encoder, seen)
    messy = "a red  &amp;amp; fox"
    with torch.no_grad():
        ids = pipe.encode_prompt(prompt=messy, do_classifier_free_guidance=False, max_sequence_length=12)[0]
    ids = ids[0, :, 0].long().tolist()
    assert words.text_tokens(pipe, messy, 12) == pipe.tokenizer.convert_ids_to_tokens(ids)
    assert words.text_tokens(pipe, messy, 12) == words.text_tokens(pipe.tokenizer, messy, 12, clean=True)
    assert words.word_positions("fox", pipe, messy, 12) == [3]


def test_allegro_labels_are_of_the_prompt_its_pipeline_lower_cases():
    if cogattn.models.allegro is None:
        pytest.skip("this diffusers lacks Allegro")
    pipe, seen = cogattn.models.allegro.tiny_pipeline(), []
    _spy(pipe.text_encoder, seen)
    shouted = "  A Red FOX running"  # the tiny vocabulary is lower-case: the bare prompt reads as <unk>s
    with torch.no_grad():
        ids = pipe.encode_prompt(prompt=shouted, do_classifier_free_guidance=False, max_sequence_length=8)[0]
    ids = ids[0, :, 0].round().long().tolist()
    assert words.text_tokens(pipe, shouted, 8) == pipe.tokenizer.convert_ids_to_tokens(ids)
    assert words.word_positions("fox", pipe, shouted, 8) == [2]
    assert words.text_tokens(pipe.tokenizer, shouted, 8)[:3] == ["<unk>"] * 3  # not the transformer's text


def test_a_source_that_is_not_a_pipeline_or_a_tokenizer_is_refused():
    with pytest.raises(TypeError, match="str is not a pipeline, a PromptFormat or a tokenizer"):
        words.text_tokens("pipe", PROMPT, 8)


def test_the_batch_tool_writes_the_transformer_s_tokens(tmp_path, dump, monkeypatch):
    """``prompt.json``'s ``tokens`` and the previews' words, for EasyAnimate's chat template."""
    from cogattn.dump import cli, previews
    from cogattn.models import easyanimate

    seen, pipes = [], []
    load = cli.load_pipeline

    def loaded(cfg, device):
        pipe = load(cfg, device)
        pipe.tokenizer = _qwen()  # its words are ids of the tiny text encoder
        original = pipe.text_encoder.forward
        pipe.text_encoder.forward = lambda input_ids=None, **kw: seen.append(input_ids) or original(input_ids, **kw)
        pipes.append(pipe)
        return pipe

    monkeypatch.setattr(cli, "load_pipeline", loaded)
    (tmp_path / "p.txt").write_text(PROMPT + "\n")
    config = easyanimate.__file__.replace("cogattn/models/easyanimate.py", "configs/tiny-easyanimate.yaml")
    sets = [f"prompts={tmp_path / 'p.txt'}", f"save_dir={tmp_path / 'runs'}", "capture.kinds=[video_to_text]",
            "num_inference_steps=1"]  # fmt: skip
    dump(config, *[a for s in sets for a in ("--set", s)], check=0)
    (meta_path,) = (tmp_path / "runs").rglob("prompt.json")
    meta = json.loads(meta_path.read_text())
    pipe = pipes[0]
    assert meta["tokens"] == pipe.tokenizer.convert_ids_to_tokens(seen[0][0].tolist())
    assert meta["tokens"][16] == "fox"
    run = cogattn.load(meta_path.parent / "maps")
    picked = previews._words(run, words.PromptFormat(pipe), PROMPT)
    assert [meta["tokens"][i] for i in picked] == ["a", "red", "fox", "running"]


def test_previews_pick_the_prompt_s_words():
    run = SimpleNamespace(layout=TokenLayout(text_len=256, frames=1, height=1, width=1))
    from cogattn.dump import previews
    from cogattn.models import easyanimate

    pipe = easyanimate.tiny_pipeline()
    pipe.tokenizer = _qwen()
    assert previews._words(run, pipe, PROMPT) == [14, 15, 16, 17]


@pytest.mark.parametrize("family", ["ltx_video", "wan"])
def test_a_bare_tokenizer_s_plot_labels_are_cleaned_only_where_the_family_s_pipeline_cleans(family):
    """Both texts are a separate cross-attention (``text_len`` 0); Wan's pipeline cleans the prompt (``&amp;`` → ``&``),
    LTX-Video's tokenizes it as it is. ``word_heatmap(..., tokenizer=pipe.tokenizer)`` names each token, and finds each
    word, as the ids its text encoder was handed: LTX-Video's 6 tokens hold ``<unk>`` for ``&amp;`` and no "dog"."""
    from cogattn import plot

    spec = cogattn.models.family(family)
    pipe, seen = spec.tiny_pipeline(), []
    encode = pipe.text_encoder.forward
    pipe.text_encoder.forward = lambda input_ids=None, *a, **kw: seen.append(input_ids) or encode(input_ids, *a, **kw)
    call = spec.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), False)
    messy = "red fox &amp; dog"
    with cogattn.record(pipe, kinds=("video_to_text",), steps=[0]) as rec:
        pipe(prompt=messy, num_inference_steps=1, **{k: v for k, v in call.items() if "prompt" not in k})
    T = rec.layout.prompt_len
    assert rec.layout.text_len == 0 and seen[0].shape[-1] == T
    want = pipe.tokenizer.convert_ids_to_tokens(seen[0][0].tolist())  # the text the transformer read
    assert (want[2], want[3]) == (("<unk>", "dog") if family == "wan" else ("<unk>", "<unk>"))
    fig = plot.word_heatmap(rec, [2, 3, "fox"], tokenizer=pipe.tokenizer, prompt=messy)
    labels = [ax.get_ylabel().split("\n")[0] for ax in fig.axes if ax.get_ylabel().startswith('"')]
    assert labels == [f'"{want[2]}" (token 2)', f'"{want[3]}" (token 3)', f'"fox" (token {want.index("fox")})']
    if "dog" in want:
        assert words.word_positions("dog", pipe.tokenizer, messy, T, clean=True) == [want.index("dog")]
    else:  # truncated away: refused, never another token's column
        with pytest.raises(ValueError, match="word 'dog' is not among"):
            plot.word_heatmap(rec, "dog", tokenizer=pipe.tokenizer, prompt=messy)


def _sentencepiece(pieces):
    """A fast T5-like sentencepiece tokenizer of ``pieces`` and the same read as a slow one (no offsets)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.Unigram([(p, -1.0) for p in ["<pad>", "</s>", "<unk>", *pieces]], unk_id=2))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")

    class Slow:  # transformers 4.x's slow T5Tokenizer: the same pieces, no character offsets
        is_fast, pad_token, all_special_tokens = False, fast.pad_token, fast.all_special_tokens
        __call__ = staticmethod(fast.__call__)
        convert_ids_to_tokens = staticmethod(fast.convert_ids_to_tokens)

    return fast, Slow()


@pytest.mark.parametrize("reader", ["offsets", "pieces"])  # "slow" would be the slow-test marker's keyword
def test_words_end_at_punctuation_and_a_word_cut_off_is_refused(reader):
    """A word ends at punctuation as at a space, with offsets or without ("red-fox": "fox" is its own word; "fox,dog":
    so is "dog"); a word of which only the first pieces are among the T tokens ("foxhound" → "▁fox" kept, "hound"
    truncated away) is refused, never named by its first piece."""
    fast, slow = _sentencepiece(["▁a", "▁red", "-", "fox", ",", "▁the", "▁fox", "hound", "dog"])
    tok = fast if reader == "offsets" else slow
    prompt = "a red-fox, the foxhound"
    ids = fast(prompt, padding="max_length", max_length=8, truncation=True)["input_ids"]
    ref = fast.convert_ids_to_tokens(ids)  # the pipelines' call: what the transformer reads
    assert ref == ["▁a", "▁red", "-", "fox", ",", "▁the", "▁fox", "</s>"]
    assert words.word_positions("fox", tok, prompt, 8) == [3]  # not the cut-off start of "foxhound"
    assert words.word_positions("red-fox", tok, prompt, 8) == [1, 3]
    with pytest.raises(ValueError, match="word 'foxhound' is cut off at the 8 prompt tokens: only its start 'fox'"):
        words.word_positions("foxhound", tok, prompt, 8)
    with pytest.raises(ValueError, match="word 'the foxhound' is cut off"):
        words.word_positions("the foxhound", tok, prompt, 8)
    assert words.word_positions("foxhound", tok, prompt, 9) == [6, 7]  # whole: both pieces
    glued = "the fox,dog"
    ref = fast.convert_ids_to_tokens(fast(glued, padding="max_length", max_length=8, truncation=True)["input_ids"])
    assert ref[:5] == ["▁the", "▁fox", ",", "dog", "</s>"]
    assert words.word_positions("fox", tok, glued, 8) == [1]
    assert words.word_positions("dog", tok, glued, 8) == [3]
