"""The audio stream's kinds (LTX-2): its self-attention, its text cross-attention, and the two cross-modal ones.

Each is a separate attention with its own softmax, so :func:`cogattn.exact.context.context_pass` forms its rows
exactly in tiles of heads × query rows and folds them here, as it does ``video_to_text``'s. A kind names its axes,
rows then columns: ``audio`` (audio bins × audio bins), ``audio_to_text`` (text key axis first, as
``video_to_text``), ``frame_audio`` (latent frames × audio bins, the video queries of each frame averaged) and
``audio_frame`` (audio bins × latent frames, the video keys of each frame summed). The audio axis is
``TokenLayout.audio`` (:class:`cogattn.audio.AudioAxis`).
"""

from __future__ import annotations

import torch

from .base import Reducer

__all__ = ["AUDIO_KINDS", "AudioReducer", "AudioToTextReducer", "FrameAudioReducer", "AudioFrameReducer"]


class AudioReducer(Reducer):
    """``audio``: ``(B, H, A, A)``, ``P[audio query a, audio key a′]`` of the audio self-attention (every row sums
    to 1)."""

    kind = "audio"
    dims = ("audio query bin", "audio key bin")
    source = "audio"
    video_queries = False  # the queries are audio bins (no history to leave out)

    @property
    def audio_len(self) -> int:
        return 0 if self.layout.audio is None else self.layout.audio.tokens

    @property
    def query_len(self) -> int:
        """Query rows of the attention, in order."""
        return self.audio_len

    @property
    def context_len(self) -> int:
        """Keys of the attention."""
        return self.audio_len

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.audio_len, self.audio_len)

    def fold_rows(self, out, h0, r0, probs):
        """``probs`` ``(h, r, C)``: rows ``r0 … r0 + r − 1`` of the attention's queries."""
        self._accumulate(out[:, r0 : r0 + probs.shape[1]], h0, probs)


class AudioToTextReducer(AudioReducer):
    """``audio_to_text``: ``(B, H, T, A)``, ``P[audio query a, text key t]`` of the audio stream's text
    cross-attention, under the text's key bias as the model adds it (each audio query's T entries sum to 1)."""

    kind = "audio_to_text"
    dims = ("text token", "audio bin")
    source = "audio_text"

    @property
    def context_len(self) -> int:
        return self.layout.context_len if self.audio_len else 0

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.context_len, self.audio_len)

    def fold_rows(self, out, h0, r0, probs):
        self._accumulate(out[:, :, r0 : r0 + probs.shape[1]], h0, probs.transpose(1, 2))


class FrameAudioReducer(AudioReducer):
    """``frame_audio``: ``(B, H, F, A)``, the mean over the video queries of latent frame f of ``P[video query,
    audio key a]`` (the video's cross-attention to the audio; each row sums to 1)."""

    kind = "frame_audio"
    dims = ("latent frame", "audio bin")
    source = "a2v"
    video_queries = True

    @property
    def query_len(self) -> int:
        return self.layout.video_len - self.layout.history_len if self.audio_len else 0

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.frames, self.audio_len)

    def fold_rows(self, out, h0, r0, probs):
        frame = torch.arange(r0, r0 + probs.shape[1], device=probs.device) // self.layout.frame_tokens
        sums = probs.new_zeros(probs.shape[0], self.layout.frames, probs.shape[2]).index_add_(1, frame, probs)
        self._accumulate(out, h0, sums.div_(self.layout.frame_tokens))


class AudioFrameReducer(AudioReducer):
    """``audio_frame``: ``(B, H, A, F)``, the sum over the video keys of latent frame f of ``P[audio query a, video
    key]`` (the audio's cross-attention to the video; each row sums to 1)."""

    kind = "audio_frame"
    dims = ("audio bin", "latent frame")
    source = "v2a"

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, queries, **sizes)
        if layout.history_len and self.audio_len:
            raise ValueError(
                f"kind 'audio_frame' sums each audio query's probabilities over a latent frame's video keys, but "
                f"{layout.history_len} video keys of this layout are off the latent grid (LTX-2's keyframe or "
                "reference tokens after it) and share the softmax; 'audio', 'audio_to_text' and 'frame_audio' are exact."
            )

    @property
    def context_len(self) -> int:
        return self.layout.video_len - self.layout.history_len if self.audio_len else 0

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.audio_len, self.layout.frames)

    def fold_rows(self, out, h0, r0, probs):
        h, r, _ = probs.shape
        per_frame = probs.view(h, r, self.layout.frames, self.layout.frame_tokens).sum(-1)
        self._accumulate(out[:, r0 : r0 + r], h0, per_frame)


AUDIO_REDUCERS = {cls.kind: cls for cls in (AudioReducer, AudioToTextReducer, FrameAudioReducer, AudioFrameReducer)}
AUDIO_KINDS = tuple(AUDIO_REDUCERS)  # the kinds of an audio stream; a family without one refuses them
