"""HunyuanVideo 1.5's own rules: the packed context's mask read as one count per item, the layout of a call
(image tokens only where the call carries an image). Its word labels' refusal is tests/test_words.py's."""

import pytest
import torch

import cogattn

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
