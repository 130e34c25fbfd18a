from types import SimpleNamespace

import pytest
import torch

import cogattn.models
from cogattn import TokenLayout

WAN = cogattn.models.wan  # None before diffusers 0.35 (no Wan attention modules)


def test_token_order_matches_patch_embedding():
    """Index of (f, y, x) is where CogVideoX's patch embedding puts that patch."""
    from cogattn.models.cogvideox import tiny_transformer

    model = tiny_transformer()
    lay = TokenLayout(text_len=8, frames=3, height=3, width=5)
    latents = torch.zeros(1, 3, 4, 6, 10)
    f, y, x = 2, 1, 4
    latents[0, f, :, 2 * y : 2 * y + 2, 2 * x : 2 * x + 2] = 1.0  # mark one patch
    with torch.no_grad():
        tokens = model.patch_embed(torch.zeros(1, 8, 16), latents)  # (1, S, D)
        base = model.patch_embed(torch.zeros(1, 8, 16), torch.zeros_like(latents))
    changed = (tokens - base).abs().sum(-1)[0].nonzero().flatten().tolist()
    assert changed == [lay.token_index(f, y, x)] == [8 + (2 * 3 + 1) * 5 + 4]


def test_layout_from_latents_1_0_and_1_5():
    cfg10 = SimpleNamespace(patch_size=2, patch_size_t=None)
    cfg15 = SimpleNamespace(patch_size=2, patch_size_t=2)
    assert TokenLayout.from_latents((2, 13, 16, 60, 90), 226, cfg10).seq_len == 17_776
    lay = TokenLayout.from_latents((2, 22, 16, 96, 170), 226, cfg15)
    assert lay.grid == (11, 48, 85) and lay.seq_len == 45_106


def test_coordinates_round_trip_and_groups():
    lay = TokenLayout(text_len=4, frames=2, height=3, width=5)
    for i in range(lay.seq_len):
        c = lay.coordinates(i)
        assert (c is None) == (i < 4)
        if c is not None:
            assert lay.token_index(*c) == i
    groups = lay.group_of_token()
    assert groups.tolist() == [0] * 4 + [1] * 15 + [2] * 15
    assert lay.group_sizes() == [4, 15, 15] and lay.num_groups == 3


def test_coordinate_outside_grid_names_ranges():
    lay = TokenLayout(text_len=4, frames=2, height=3, width=5)
    with pytest.raises(ValueError, match=r"\(2, 0, 0\).*frame 0..1"):
        lay.token_index(2, 0, 0)


# -- latent ↔ pixel frames, as the pipelines and their VAEs make them -------------------------------------
@pytest.fixture(scope="module")
def decoded_frames():
    """Frames each tiny VAE decodes from L latent frames (the real VAE code at toy width), L = 1..6."""
    from cogattn.models.cogvideox import tiny_vae

    cog = tiny_vae()
    with torch.no_grad():
        frames = {"cogvideox": {n: cog.decode(torch.zeros(1, 4, n, 2, 2)).sample.shape[2] for n in range(1, 7)}}
        if WAN:  # diffusers ≥ 0.35
            wan = WAN.tiny_pipeline().vae
            frames["wan"] = {
                n: wan.decode(torch.zeros(1, wan.config.z_dim, n, 2, 2)).sample.shape[2] for n in range(1, 7)
            }
    return frames


def _covers_in_order(owner: list[int], frames: int) -> bool:
    return owner == sorted(owner) and sorted(set(owner)) == list(range(frames))


def test_every_decoded_pixel_frame_has_its_latent_frame(decoded_frames):
    # CogVideoX's VAE decodes latent frames in pairs (an odd count: the first three together), so an even L
    # gives 4L frames, 4 per latent frame from frame 0; Wan's causal VAE gives 4(L - 1) + 1 for every L.
    assert decoded_frames["cogvideox"] == {1: 1, 2: 8, 3: 9, 4: 16, 5: 17, 6: 24}
    assert not WAN or decoded_frames["wan"] == {1: 1, 2: 5, 3: 9, 4: 13, 5: 17, 6: 21}
    assert TokenLayout(8, 4, 3, 5).latent_of_pixel(16) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert TokenLayout(8, 3, 3, 5).latent_of_pixel(9) == [0] + [1] * 4 + [2] * 4
    for n in range(1, 22):  # num_frames of the call, 4k + 1 or not
        latent = (n - 1) // 4 + 1  # pipeline_cogvideox.py: latent_frames
        for pt in (None, 2):
            lay = TokenLayout.for_video(n, 48, 80, 8, patch_size_t=pt)
            assert lay.frames == ((latent + 1) // 2 if pt else latent), (n, pt)
            owner = lay.latent_of_pixel(decoded_frames["cogvideox"][latent])  # 1.5 drops its padding first
            assert _covers_in_order(owner, lay.frames), (n, pt, owner)
        if not WAN:
            continue
        latent = (n // 4 * 4 + 1 - 1) // 4 + 1  # pipeline_wan.py rounds num_frames to num_frames // 4 * 4 + 1
        lay = WAN.layout_for_video(WAN.KNOWN["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"], n, 32, 48, None)
        assert lay.frames == latent, n
        assert _covers_in_order(lay.latent_of_pixel(decoded_frames["wan"][latent]), latent), n
    with pytest.raises(ValueError, match=r"never 10 frames.*F = 3.*: 9"):
        TokenLayout(8, 3, 3, 5).pixel_frames(10)


def test_a_cogvideox_video_of_an_even_latent_count_is_mapped_whole():
    import cogattn
    from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline

    pipe = tiny_pipeline()
    emb = torch.randn(1, TINY_TEXT_LEN, 16, generator=torch.Generator().manual_seed(0))
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, num_inference_steps=1, height=48, width=80)
    with cogattn.record(pipe, kinds="frame") as rec:
        video = pipe(num_frames=13, max_sequence_length=TINY_TEXT_LEN, output_type="pt", **call).frames
    assert rec.layout.frames == 4 and video.shape[1] == 16  # 13 frames asked: 4 latent frames, decoded to 16
    assert rec.layout.latent_of_pixel(16) == [f for f in range(4) for _ in range(4)]


def test_a_vae_of_temporal_factor_6_decodes_6k_plus_1_frames_only():
    """Mochi's VAE: L latent frames are 6(L − 1) + 1 frames; CogVideoX's 4L rule for an even L is its own."""
    lay = cogattn.TokenLayout(0, 2, 2, 3, temporal_compression=6)
    assert lay.decoded_frames() == [7] and [list(r) for r in lay.pixel_frames(7)] == [[0], [1, 2, 3, 4, 5, 6]]
    with pytest.raises(ValueError, match="never 12 frames"):
        lay.pixel_frames(12)
    assert cogattn.TokenLayout(0, 2, 2, 3).decoded_frames() == [5, 8]  # CogVideoX decodes an even L to 4L


def test_a_vae_that_is_not_causal_packs_its_frames_from_frame_0_and_the_pipeline_crops_the_last():
    """Allegro's VAE: latent frame l is pixel frames 4l … 4l + 3 for any L, the last cropped to the call's count;
    its run values say so, and the batch tool takes 4k or 4k + 1 frames of it."""
    from pathlib import Path

    from cogattn.errors import StoreError
    from cogattn.runs.run_values import checked_layout

    lay = cogattn.TokenLayout(0, 3, 2, 3, causal_vae=False)
    assert [list(r) for r in lay.pixel_frames(12)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [list(r) for r in lay.pixel_frames(9)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert lay.decoded_frames() == [9, 10, 11, 12] and lay.default_pixel_frames is None
    assert lay.latent_of_pixel(10) == [0] * 4 + [1] * 4 + [2] * 2
    for n in (8, 13):
        with pytest.raises(ValueError, match=f"never {n}"):
            lay.pixel_frames(n)
    fields = {"text_len": 0, "frames": 3, "height": 2, "width": 3}
    assert checked_layout({**fields, "causal_vae": False}, Path("run.json")) == lay
    assert checked_layout(fields, Path("run.json")).causal_vae  # a run from before the field: causal
    with pytest.raises(StoreError, match="causal_vae = 'no'; it is true or false"):
        checked_layout({**fields, "causal_vae": "no"}, Path("run.json"))
    if cogattn.models.allegro is None:
        return
    from cogattn.dump.config import ConfigError, load_config

    root = Path(__file__).resolve().parents[1] / "configs"
    for n in (12, 13):
        assert load_config(root / "tiny-allegro.yaml", [f"num_frames={n}"]).num_frames == n
    with pytest.raises(ConfigError, match="decodes 4 frames per latent frame .*: use 12 or 16"):
        load_config(root / "tiny-allegro.yaml", ["num_frames=14"])


def test_a_vae_other_than_4x_decodes_one_count_for_an_even_number_of_latent_frames():
    """Only a 4× VAE (CogVideoX's) decodes pairs of latent frames: Mochi's 19 frames (4 latent frames of 6) and
    LTX's 121 (16 of 8) are the layout's own count (it was None: their figures lost the pixel-frame labels), and a
    wrong count is refused without naming CogVideoX's pairs."""
    mochi, ltx = TokenLayout(0, 4, 2, 2, temporal_compression=6), TokenLayout(0, 16, 2, 2, temporal_compression=8)
    assert (mochi.default_pixel_frames, ltx.default_pixel_frames) == (19, 121) == (mochi.decoded_frames()[0], 121)
    assert [len(r) for r in mochi.pixel_frames(19)] == [1, 6, 6, 6]
    assert TokenLayout(0, 4, 2, 2).default_pixel_frames is None  # CogVideoX's 16 or Wan's 13
    with pytest.raises(ValueError, match=r"6L − 5 frames for L latent frames, never 24 frames; .*: 19\.$") as err:
        mochi.pixel_frames(24)
    assert "CogVideoX" not in str(err.value)
