import torch

import cogattn  # noqa: F401  (the later snippets of the page use it)
from cogattn import plot  # noqa: F401
from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline

pipe = tiny_pipeline()  # the tiny random CogVideoX of Getting started (random weights: the maps mean nothing)
prompt = "a red fox running in the snow"


def generate():
    """Getting started's call: the same seeded video, (9, 3, 48, 80), each time."""
    return pipe(
        prompt=prompt,
        num_frames=9,
        num_inference_steps=4,
        max_sequence_length=TINY_TEXT_LEN,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames[0]
