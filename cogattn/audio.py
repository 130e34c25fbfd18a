"""The audio stream's time axis (LTX-2): :class:`AudioAxis`, held by ``TokenLayout.audio``.

An audio-video model runs a second sequence beside the video: one token per latent audio bin, each bin all mel
bins of ``compression`` mel frames. LTX-2's audio VAE makes 25 bins a second (16 kHz, hop 160, 4 mel frames a
bin) and shifts them by one mel frame (its causal offset): bin ``i`` covers mel frames ``[max(0, 4i − 3), 4i + 1)``,
seconds ``[max(0, i − 3/4) / 25, (i + 1/4) / 25)``. The video's latent frame ``f`` covers pixel frames
``[max(0, c·f − c + 1), c·f + 1)`` (``c`` the VAE's temporal factor), seconds that over the playback rate ``fps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AudioAxis"]


@dataclass(frozen=True)
class AudioAxis:
    """The audio tokens of an audio-video call, one per latent time bin, and their time.

    Args:
        tokens (`int`): audio tokens A (latent bins) of the call.
        rate (`float`, defaults to 25.0): latent bins per second (sampling rate / hop / ``compression``).
        compression (`int`, defaults to 4): mel frames per bin; the bins start one mel frame late (causal).
        fps (`float`, defaults to 24.0): the video's playback frame rate (LTX-2's pipelines' ``frame_rate``; the
            transformer's ``fps`` for a bare call), which places the video's frames in seconds.
    """

    tokens: int
    rate: float = 25.0
    compression: int = 4
    fps: float = 24.0

    def __post_init__(self):
        if self.tokens < 1 or self.rate <= 0 or self.compression < 1 or self.fps <= 0:
            raise ValueError(f"{self}: the audio tokens, bins per second, mel frames per bin and fps are positive.")

    def seconds(self) -> torch.Tensor:
        """``(A, 2)`` float64 ``[start, end)`` of each bin in seconds (the model's ``audio_coords``)."""
        c, i = self.compression, torch.arange(self.tokens, dtype=torch.float64)
        start = (c * i + 1 - c).clamp(min=0) / c
        return torch.stack([start, (c * i + 1) / c], -1) / self.rate

    def frame_seconds(self, layout) -> torch.Tensor:
        """``(F, 2)`` float64 ``[start, end)`` in seconds of each latent frame of ``layout`` (a `TokenLayout`) at
        ``fps``: frame 0 is pixel frame 0 alone, frame f ≥ 1 the ``temporal_compression`` frames ending at c·f."""
        c, f = layout.temporal_compression, torch.arange(layout.frames, dtype=torch.float64)
        return torch.stack([(c * f + 1 - c).clamp(min=0), c * f + 1], -1) / self.fps

    def frame_of_bin(self, layout) -> torch.Tensor:
        """``(A,)`` the latent frame of ``layout`` whose span holds each bin's midpoint (the last for bins after the
        video's end)."""
        mid = self.seconds().mean(-1)
        c = layout.temporal_compression
        return ((mid * self.fps + c - 1) / c).floor().clamp(0, layout.frames - 1).long()
