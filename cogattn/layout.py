"""Token layout of CogVideoX's joint text + video sequence.

Token order (the model's own): text tokens ``[0, T)``, then video token
``T + f·Hp·Wp + y·Wp + x`` for latent frame (temporal patch) ``f``, patch row ``y``, patch column ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenLayout"]


@dataclass(frozen=True)
class TokenLayout:
    """Where each token of the joint sequence comes from.

    Args:
        text_len (`int`): number of text tokens T.
        frames (`int`): latent frames F seen by attention (temporal patches when ``patch_size_t`` is set).
        height (`int`): patch rows Hp.
        width (`int`): patch columns Wp.
        patch_size (`int`, defaults to 2): spatial patch size in latent pixels.
        patch_size_t (`int | None`, defaults to `None`): temporal patch size (CogVideoX 1.5), `None` for 1.0.
    """

    text_len: int
    frames: int
    height: int
    width: int
    patch_size: int = 2
    patch_size_t: int | None = None

    @classmethod
    def from_latents(cls, latent_shape: tuple[int, ...], text_len: int, config) -> "TokenLayout":
        """Build from the transformer's input latents ``(B, F, C, H, W)`` and its config."""
        _, frames, _, height, width = latent_shape
        p, pt = int(config.patch_size), config.patch_size_t
        return cls(
            text_len=int(text_len),
            frames=frames // pt if pt else frames,
            height=height // p,
            width=width // p,
            patch_size=p,
            patch_size_t=int(pt) if pt else None,
        )

    @property
    def frame_tokens(self) -> int:
        """Video tokens per latent frame, Hp·Wp."""
        return self.height * self.width

    @property
    def video_len(self) -> int:
        """Number of video tokens, F·Hp·Wp."""
        return self.frames * self.frame_tokens

    @property
    def seq_len(self) -> int:
        """Length S of the joint sequence, T + F·Hp·Wp."""
        return self.text_len + self.video_len

    @property
    def grid(self) -> tuple[int, int, int]:
        """Latent patch grid (F, Hp, Wp)."""
        return (self.frames, self.height, self.width)

    @property
    def num_groups(self) -> int:
        """Frame groups G = F + 1: group 0 is the text, group g ≥ 1 is latent frame g − 1."""
        return self.frames + 1

    def token_index(self, frame: int, row: int, col: int) -> int:
        """Sequence index of the video token at latent frame ``frame``, patch row ``row``, column ``col``."""
        if not (0 <= frame < self.frames and 0 <= row < self.height and 0 <= col < self.width):
            raise ValueError(
                f"video coordinate (frame, row, col) = {(frame, row, col)} is outside the latent grid "
                f"(F, Hp, Wp) = {self.grid}; valid ranges are frame 0..{self.frames - 1}, "
                f"row 0..{self.height - 1}, col 0..{self.width - 1}."
            )
        return self.text_len + (frame * self.height + row) * self.width + col

    def coordinates(self, index: int) -> tuple[int, int, int] | None:
        """``(frame, row, col)`` of a video token, or `None` for a text token."""
        if not 0 <= index < self.seq_len:
            raise ValueError(f"token index {index} is outside the sequence [0, {self.seq_len}).")
        if index < self.text_len:
            return None
        v = index - self.text_len
        frame, rest = divmod(v, self.frame_tokens)
        row, col = divmod(rest, self.width)
        return (frame, row, col)

    def group_of_token(self, device=None) -> torch.Tensor:
        """Frame group of every token, shape ``(S,)``: 0 for text, ``f + 1`` for latent frame ``f``."""
        text = torch.zeros(self.text_len, dtype=torch.long, device=device)
        video = torch.arange(1, self.frames + 1, device=device).repeat_interleave(self.frame_tokens)
        return torch.cat([text, video])

    def group_sizes(self) -> list[int]:
        """Tokens in each frame group: ``[T, Hp·Wp, ..., Hp·Wp]``."""
        return [self.text_len] + [self.frame_tokens] * self.frames
