"""The sizes of a pipeline call a family's pipeline takes: frames the VAE decodes, pixels in whole patches, at
least one step. One rule for the batch tool's config (``cogattn.dump.rules.check_call``) and for
:func:`cogattn.estimate`, so that a size the pipeline would refuse is refused before anything is planned."""

from __future__ import annotations

import operator

from .spec import ModelSpec

__all__ = ["check_sizes"]


def check_sizes(
    spec: ModelSpec, config: dict, *, num_frames, height, width, num_inference_steps, padded: bool = True
) -> None:
    """Refuse, in one `ValueError` line naming the value, a call of ``num_frames`` × ``height`` × ``width`` pixels
    over ``num_inference_steps`` that the family's pipeline (its model ``config``) would refuse or misread: whole
    numbers only, at least one step, the VAE's tk + 1 frames (tk or tk + 1 for Allegro's; a VAE of clips, its
    family's own rule; any number where the call is made in windows), pixels in whole patches of the VAE's and the transformer's, or in whole latent pixels where
    the transformer pads its latents to whole patches (Cosmos 3's) and ``padded`` takes such calls (the batch tool
    does not: its previews place whole patches on the video)."""
    sizes = {"num_frames": num_frames, "height": height, "width": width, "num_inference_steps": num_inference_steps}
    for key, value in sizes.items():
        try:
            if isinstance(value, bool):
                raise TypeError
            operator.index(value)
        except TypeError:
            raise ValueError(f"{key}: {value!r} must be a whole number.") from None
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps: {num_inference_steps!r} must be at least 1.")
    layout = spec.layout_for_video(config, 1, 16, 16, 1)
    tc = layout.temporal_compression  # the VAE's: 4, Mochi's 6, LTX-Video's 8
    if spec.call_steps is not None:  # a call made in windows (FramePack's sections, Helios's chunks): any count
        if num_frames < 1:
            raise ValueError(f"num_frames: {num_frames!r} must be at least 1 ({spec.frame_counts}).")
    elif not layout.causal_vae and (num_frames < 1 or num_frames % tc > 1):  # Allegro's: tc frames from frame 0
        below = max(tc, num_frames // tc * tc)
        raise ValueError(
            f"num_frames: {num_frames!r}; the {spec.title} VAE decodes {tc} frames per latent frame "
            f"({spec.frame_counts}): use {below} or {below + tc}."
        )
    elif layout.causal_vae and not layout.clip_latents and (num_frames < 1 or (num_frames - 1) % tc):
        below = max(1, (num_frames - 1) // tc * tc + 1)
        raise ValueError(
            f"num_frames: {num_frames!r}; the {spec.title} VAE decodes {tc}k + 1 frames ({spec.frame_counts}): "
            f"use {below} or {below + tc}."
        )
    vae, patch = spec.pixels_per_patch(config)
    # a transformer that pads its latents to whole patches (Cosmos 3's) takes any whole latent pixel
    probe = vae * (patch + 1)
    pads = padded and patch > 1 and spec.layout_for_video(config, 1, probe, probe, 1).height * patch > probe // vae
    step, why = (
        (vae, f"the {spec.title} VAE's {vae}; the transformer pads to whole patches of {patch}")
        if pads
        else (vae * patch, f"the {spec.title} VAE's {vae} × the patch size {patch}")
    )
    for key, value in (("height", height), ("width", width)):
        if value < step or value % step:
            raise ValueError(f"{key}: {value!r} must be a positive multiple of {step} ({why}).")
