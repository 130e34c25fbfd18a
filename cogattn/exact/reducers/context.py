"""The kinds of an attention beside the self-attention (a cross-attention's: Wan's ``attn2``, video queries over the
text or image context), whose rows :func:`cogattn.exact.context.context_pass` forms and folds."""

from __future__ import annotations

from .base import Reducer

__all__ = ["ContextReducer", "VideoToImageReducer"]


class ContextReducer(Reducer):
    """``video_to_text`` of a cross-attention: ``(B, H, T, F, Hp, Wp)``, ``P[video query (f, y, x), text
    key t]`` with the softmax over the text keys (and the image's before them, where they share it:
    ``TokenLayout.image_joins_text``); the queries are the grid's (a video token off the grid, a history
    latent's, has no (f, y, x): its row is no part of the kind)."""

    kind = "video_to_text"
    dims = ("text token", "latent frame", "patch row", "patch column")
    source = "text"
    video_queries = True  # the queries are the grid's video tokens (a history before it is left out)

    @property
    def query_len(self) -> int:
        """Query rows of the attention, in order: the grid's."""
        return self.layout.video_len - self.layout.history_len

    @property
    def context_len(self) -> int:
        """Keys of the attention: the text's, and the image's where they share its softmax."""
        return self.layout.context_len + (self.layout.image_len if self.layout.image_joins_text else 0)

    @property
    def columns(self) -> slice:
        """This kind's keys among the attention's: the text's, after the image's where they share the softmax."""
        start = self.layout.image_len if self.layout.image_joins_text else 0
        return slice(start, start + self.layout.context_len)

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.columns.stop - self.columns.start, *self.layout.grid)

    def fold_rows(self, out, h0, r0, probs):
        """``probs`` ``(h, r, C)``: the rows of the grid's queries ``r0 … r0 + r − 1``, over the attention's keys."""
        flat = out.view(*out.shape[:2], self.layout.video_len - self.layout.history_len)
        self._accumulate(flat[:, :, r0 : r0 + probs.shape[1]], h0, probs[..., self.columns].transpose(1, 2))


class VideoToImageReducer(ContextReducer):
    """``video_to_image``: ``(B, H, I, F, Hp, Wp)``, ``P[video query (f, y, x), image key i]`` of Wan 2.1
    image-to-video's image cross-attention (its own softmax over the I = 257 CLIP tokens), or the image's
    columns of the text's where the image tokens join its softmax (``TokenLayout.image_joins_text``)."""

    kind = "video_to_image"
    dims = ("image token", "latent frame", "patch row", "patch column")
    source = "image"

    @property
    def context_len(self) -> int:
        """Keys of the attention: the image's, and the text's where they share its softmax."""
        return self.layout.image_len + (self.layout.context_len if self.layout.image_joins_text else 0)

    @property
    def columns(self) -> slice:
        return slice(0, self.layout.image_len)
