"""Child process for the crash test: records a long generation to disk until it is killed."""

import sys

import torch

import cogattn
from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline

out = sys.argv[1]
pipe = tiny_pipeline(num_heads=4)
emb = torch.randn(1, TINY_TEXT_LEN, 16)
with cogattn.record(pipe, kinds=("full", "frame", "video_to_text"), heads="all", save_dir=out):
    print("started", flush=True)
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
