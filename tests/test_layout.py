from types import SimpleNamespace

import pytest
import torch

from cogattn import TokenLayout


def test_token_order_matches_patch_embedding():
    """Index of (f, y, x) is where CogVideoX's patch embedding puts that patch."""
    from cogattn.testing import tiny_transformer

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
