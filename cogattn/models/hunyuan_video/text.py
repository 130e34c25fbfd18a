"""HunyuanVideo's text of a prompt, as its pipelines make it: the prompt in the LLaMA template, the
template's first ``crop_start`` tokens cropped (image-to-video: also the assistant header after the prompt)."""

from __future__ import annotations

import inspect

from ..prompt_text import in_template, kept, pipeline_text, tokenize

__all__ = ["ASSISTANT_TOKENS", "prompt_text"]

ASSISTANT_TOKENS = 4  # tokens of the image-to-video template's assistant header, cropped after the prompt


def prompt_text(pipeline, prompt: str, length: int, template: dict | None = None, offsets: bool = False):
    """The ``length`` text tokens the transformer reads for ``prompt``, as HunyuanVideo's pipelines make them
    (``_get_llama_prompt_embeds``; ``ModelSpec.prompt_text``), image tokens not included.

    The prompt goes in ``template`` (the call's ``prompt_template``; `None`: the default of the pipeline's
    call, its module's ``DEFAULT_PROMPT_TEMPLATE``), is tokenized to ``crop_start`` + its length, and the
    first ``crop_start`` tokens (the template's, the BOS among them) are cropped; image-to-video also crops
    the 4 tokens before the last ``<|end_header_id|>``'s next one (``<|eot_id|>`` and the assistant header),
    so its text is ``max_sequence_length − 4`` tokens.
    """
    tokenizer = pipeline.tokenizer
    if template is None:
        default = inspect.signature(pipeline.__call__).parameters.get("prompt_template")
        if default is None or not isinstance(default.default, dict):  # a pipeline whose call takes no template
            return pipeline_text(pipeline, prompt, length, None, offsets)
        template = default.default
    i2v = type(pipeline).__name__ == "HunyuanVideoImageToVideoPipeline" or "image_emb_len" in template
    text = in_template(prompt, template["template"].format)
    crop = template.get("crop_start")
    if crop is None:  # the pipeline's own count: the template's tokens less its placeholder and closing ones
        whole = tokenizer(template["template"], padding="max_length", return_attention_mask=False)
        crop = len(whole["input_ids"]) - (5 if i2v else 2)
    crop = max(int(crop), 0)
    if not i2v or crop == 0:  # uncropped, image-to-video keeps the LLaVA tokens inside the text: not named
        return kept(tokenize(tokenizer, text.text, length + crop, offsets), text, list(range(crop, length + crop)))
    enc = tokenize(tokenizer, text.text, length + crop + ASSISTANT_TOKENS, offsets)
    ids, end = list(enc["input_ids"]), tokenizer.convert_tokens_to_ids("<|end_header_id|>")
    heads = [i for i, t in enumerate(ids) if t == end]
    after = heads[-1] + 1 if len(heads) not in (0, 2) else len(ids)  # two: the prompt cut the assistant header off
    return kept(enc, text, list(range(crop, after - ASSISTANT_TOKENS)) + list(range(after, len(ids))))
