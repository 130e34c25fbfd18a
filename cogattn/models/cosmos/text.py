"""Cosmos' text of a prompt, as its pipelines make it: Predict2.5's and Transfer2.5's put the prompt in Qwen2.5-VL's
chat template, after a system turn; Predict1's and Predict2's tokenize it alone (T5)."""

from __future__ import annotations

from ..prompt_text import in_template, kept, pipeline_text, tokenize

__all__ = ["SYSTEM_PROMPT", "prompt_text"]

# the system turn of Cosmos2_5_PredictBasePipeline._get_prompt_embeds (Transfer2.5's too)
SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False):
    """The ``length`` text tokens the transformer reads for ``prompt`` (``ModelSpec.prompt_text``): for Predict2.5 and
    Transfer2.5 (``Cosmos2_5_*`` pipelines), as their ``_get_prompt_embeds`` makes them, the system turn then the
    prompt as the user's turn in the tokenizer's chat template, no generation prompt, padded to ``length`` on the
    right, nothing cropped; for Predict1 and Predict2, the prompt alone. ``template`` is unused (the calls take none).
    """
    if not type(pipeline).__name__.startswith("Cosmos2_5_"):
        return pipeline_text(pipeline, prompt, length, None, offsets)
    tokenizer = pipeline.tokenizer

    def chat(text: str) -> str:
        turns = [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
            {"role": "user", "content": [{"type": "text", "text": text}]},
        ]
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False, add_vision_id=False)

    text = in_template(prompt, chat)
    # apply_chat_template(tokenize=True) adds no special tokens: the template has them; it pads on the tokenizer's side
    return kept(tokenize(tokenizer, text.text, length, offsets, add_special_tokens=False), text)
