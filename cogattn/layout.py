"""Where every token and every frame comes from: the attention sequence and the decoded video (which keys pool
together: :class:`cogattn.exact.key_groups.KeyGroups`).

Token order (the model's own): video token ``v0 + f·Hp·Wp + y·Wp + x`` for latent frame (temporal patch)
``f``, patch row ``y``, patch column ``x``, and ``T`` text tokens before the video (CogVideoX: ``v0 = T``,
text ``[0, T)``) or after it (HunyuanVideo: ``v0 = 0``, text ``[V, V + T)``; ``text_position``). In
CogVideoX and HunyuanVideo the text is part of the one joint sequence (``text_len = T``). In Wan the
self-attention sequence is the video alone (``text_len = 0``) and the text (``context_len`` tokens) and,
for Wan 2.1 image-to-video, the image (``image_len`` tokens) are keys of a separate cross-attention.
Frame group 0 is the text wherever it sits (:meth:`TokenLayout.group_of_token`). HunyuanVideo FramePack's
video starts with ``history_len`` tokens off the grid (its history latents): its grid starts at
``v0 + history_len``, and it has no frame groups.

Frames (the VAE's geometry, kept here and nowhere else): the VAEs keep pixel frame 0 as latent frame 0
and pack each later group of 4 pixel frames into one latent frame, and compress space by 8. Wan's causal
VAE decodes L latent frames to 4(L − 1) + 1 pixel frames; CogVideoX's decodes them in pairs (an odd L:
the first three together, as Wan would), so an even L gives 4L pixel frames, 4 per latent frame from
frame 0. No decoded video has 4k + 2 or 4k + 3 frames: a call's ``num_frames`` is rounded (Wan's
pipelines to ``num_frames // 4 * 4 + 1``; CogVideoX's make ``(num_frames - 1) // 4 + 1`` latent frames).
With ``patch_size_t = p`` (CogVideoX 1.5) the pipeline pads latent frames at the start up to a multiple of p.
An audio-video model's audio tokens are a sequence of their own (``TokenLayout.audio``, :mod:`cogattn.audio`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .audio import AudioAxis

__all__ = ["TokenLayout", "VAE_SPATIAL", "VAE_TEMPORAL"]

VAE_TEMPORAL = 4  # pixel frames per latent frame after the first (every CogVideoX VAE)
VAE_SPATIAL = 8  # pixels per latent pixel, each way (Wan 2.2 TI2V-5B: 16)


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
        context_len (`int`, defaults to 0): text tokens of a separate cross-attention (Wan: 512); 0 when
            the text is in the sequence.
        image_len (`int`, defaults to 0): image tokens of a separate cross-attention (Wan 2.1
            image-to-video: 257 CLIP tokens); with the text in the sequence, the image tokens that lead
            the text (HunyuanVideo image-to-video: its LLaVA's, counted in ``text_len``, before the prompt's).
        text_position (`str`, defaults to ``"start"``): where the text sits in the sequence, ``"start"``
            (CogVideoX) or ``"end"`` (HunyuanVideo, after the video).
        temporal_compression (`int`, defaults to 4): pixel frames per latent frame after the first, the
            VAE's ``vae_scale_factor_temporal`` (Mochi's is 6).
        history_len (`int`, defaults to 0): video tokens off the latent grid, before the grid's first
            (FramePack's clean and 2×/4× downsampled history latents; LTX-2's keyframe and reference tokens,
            moved first for the capture); video tokens (``video_len`` counts them) of no frame: no frame groups.
        causal_vae (`bool`, defaults to `True`): whether the VAE keeps pixel frame 0 as latent frame 0 (Wan,
            CogVideoX and the others), or packs every ``temporal_compression`` frames from frame 0 and decodes that
            many per latent frame, the pipeline cropping the last (Allegro's).
        text_parts (`tuple[tuple[str, int], ...]`, defaults to ``()``): parts packed per item, their padded sizes in
            order (HunyuanVideo 1.5's image, glyph, prompt); each item's own spans: ``Recording.text_spans``.
        prompt_crop (`int`, defaults to 0): template tokens the pipeline crops before the prompt (HunyuanVideo 1.5).
        audio (`AudioAxis | None`, defaults to `None`): the audio stream of an audio-video model (LTX-2), a sequence
            of its own beside this one's video (and text); `None` for a model without one.
        image_joins_text (`bool`, defaults to `False`): the image tokens lead the text in its cross-attention's softmax.
        grids (`int`, defaults to 1): copies of the video's grid along the frame axis, each ``frames / grids`` latent
            frames of the one video (a layer over two: Motif-Video's decoder layers, its decoder's frames first).
        clip_latents (`int`, defaults to 0): latent frames of each clip a causal VAE encodes on its own, the pixel
            frames restarting at each (MiniMax-H3's: 5 of 17 frames, ``17 n + 5`` frames in ``5 n + 2``); 0: one clip.
    """

    text_len: int
    frames: int
    height: int
    width: int
    patch_size: int = 2
    patch_size_t: int | None = None
    context_len: int = 0
    image_len: int = 0
    text_position: str = "start"
    temporal_compression: int = VAE_TEMPORAL
    history_len: int = 0
    causal_vae: bool = True
    text_parts: tuple[tuple[str, int], ...] = ()
    prompt_crop: int = 0
    audio: AudioAxis | None = None
    image_joins_text: bool = False
    grids: int = 1
    clip_latents: int = 0

    def __post_init__(self):
        if self.grids < 1 or self.frames % self.grids:
            raise ValueError(f"grids={self.grids}; the {self.frames} latent frames are whole copies of one grid.")
        if self.text_position not in ("start", "end"):
            raise ValueError(f"text_position={self.text_position!r}; the text sits at the 'start' or the 'end'.")
        if self.history_len < 0:
            raise ValueError(f"history_len={self.history_len}; the tokens off the grid are a count, 0 or more.")
        if self.text_parts and sum(n for _, n in self.text_parts) != self.text_len:
            raise ValueError(f"text_parts={self.text_parts}; the parts' sizes sum to text_len={self.text_len}.")

    @classmethod
    def from_latents(cls, latent_shape: tuple[int, ...], text_len: int, config) -> TokenLayout:
        """Build from the transformer's input latents ``(B, F, C, H, W)`` and its config."""
        _, frames, _, height, width = latent_shape
        p, pt = int(config.patch_size), getattr(config, "patch_size_t", None)  # ConsisID has none
        return cls(
            text_len=int(text_len),
            frames=frames // pt if pt else frames,
            height=height // p,
            width=width // p,
            patch_size=p,
            patch_size_t=int(pt) if pt else None,
        )

    @classmethod
    def of_video_latents(cls, latent_shape: tuple[int, ...], patch_size, **fields) -> TokenLayout:
        """The layout of a sequence that is the video alone (a cross-attention's context lengths in ``fields``: Wan,
        Cosmos), from latents ``(B, C, F, H, W)`` in patches ``(p_t, p_h, p_w)``."""
        _, _, frames, height, width = latent_shape
        p_t, p_h, p_w = (int(p) for p in patch_size)
        return cls(
            text_len=0,
            frames=frames // p_t,
            height=height // p_h,
            width=width // p_w,
            patch_size=p_h,
            patch_size_t=p_t if p_t > 1 else None,
            **fields,
        )

    @classmethod
    def for_video(
        cls,
        num_frames: int,
        height: int,
        width: int,
        text_len: int,
        patch_size: int = 2,
        patch_size_t: int | None = None,
        *,
        spatial_compression: int = VAE_SPATIAL,
        context_len: int = 0,
        image_len: int = 0,
        text_position: str = "start",
        temporal_compression: int = VAE_TEMPORAL,
        causal_vae: bool = True,
    ) -> TokenLayout:
        """The layout a pipeline call for ``num_frames`` frames of ``height`` × ``width`` pixels produces
        (``spatial_compression``: the VAE's pixels per latent pixel)."""
        latent = (int(num_frames) - 1) // int(temporal_compression) + 1
        pt = patch_size_t or 1
        latent += (-latent) % pt  # CogVideoX 1.5 pads at the start
        return cls(
            text_len=int(text_len),
            frames=latent // pt,
            height=int(height) // spatial_compression // patch_size,
            width=int(width) // spatial_compression // patch_size,
            patch_size=patch_size,
            patch_size_t=patch_size_t or None,
            context_len=int(context_len),
            image_len=int(image_len),
            text_position=text_position,
            temporal_compression=int(temporal_compression),
            causal_vae=causal_vae,
        )

    @property
    def frame_tokens(self) -> int:
        """Video tokens per latent frame, Hp·Wp."""
        return self.height * self.width

    @property
    def video_len(self) -> int:
        """Number of video tokens, F·Hp·Wp (and the ``history_len`` before the grid's)."""
        return self.history_len + self.frames * self.frame_tokens

    @property
    def seq_len(self) -> int:
        """Length S of the joint sequence, T + F·Hp·Wp."""
        return self.text_len + self.video_len

    @property
    def video_start(self) -> int:
        """Sequence index of the first video token: T with the text first, else 0."""
        return self.text_len if self.text_position == "start" else 0

    @property
    def text_start(self) -> int:
        """Sequence index of the first text token: 0 with the text first, else V."""
        return 0 if self.text_position == "start" else self.video_len

    @property
    def video_tokens(self) -> slice:
        """The video tokens' positions in the sequence."""
        return slice(self.video_start, self.video_start + self.video_len)

    @property
    def text_tokens(self) -> slice:
        """The text tokens' positions in the sequence."""
        return slice(self.text_start, self.text_start + self.text_len)

    @property
    def grid_tokens(self) -> slice:
        """The positions of the video tokens on the latent grid (all of them but a ``history_len``)."""
        return slice(self.video_start + self.history_len, self.video_start + self.video_len)

    def text_kept(self, keys: int) -> int:
        """Text tokens among the first ``keys`` tokens (an item's valid text under a key mask keeping those)."""
        return max(0, min(int(keys), self.text_start + self.text_len) - self.text_start)

    @property
    def grid(self) -> tuple[int, int, int]:
        """Latent patch grid (F, Hp, Wp)."""
        return (self.frames, self.height, self.width)

    @property
    def prompt_len(self) -> int:
        """Text tokens of the prompt, in the sequence or in the cross-attention (the T of ``video_to_text``)."""
        return self.text_len or self.context_len

    @property
    def prompt_start(self) -> int:
        """Index of the prompt's first token among the ``prompt_len`` text tokens: the ``image_len`` image
        tokens that lead the text in the sequence (HunyuanVideo image-to-video), else 0."""
        return self.image_len if self.text_len else 0

    def spans(self) -> dict[str, tuple[int, int]]:
        """Every item's text spans where the text is not packed per item: the image's, then the prompt's to T."""
        return {"image": (0, self.prompt_start), "prompt": (self.prompt_start, self.prompt_len)}

    @property
    def text_groups(self) -> int:
        """1 when the sequence starts with a text group, 0 when it is the video alone (Wan)."""
        return 1 if self.text_len else 0

    @property
    def num_groups(self) -> int:
        """Frame groups G: with text in the sequence F + 1 (group 0 is the text, group g ≥ 1 latent frame
        g − 1); without, F (group g is latent frame g)."""
        return self.frames + self.text_groups

    def token_index(self, frame: int, row: int, col: int) -> int:
        """Sequence index of the video token at latent frame ``frame``, patch row ``row``, column ``col``."""
        if not (0 <= frame < self.frames and 0 <= row < self.height and 0 <= col < self.width):
            raise ValueError(
                f"video coordinate (frame, row, col) = {(frame, row, col)} is outside the latent grid "
                f"(F, Hp, Wp) = {self.grid}; valid ranges are frame 0..{self.frames - 1}, "
                f"row 0..{self.height - 1}, col 0..{self.width - 1}."
            )
        return self.grid_tokens.start + (frame * self.height + row) * self.width + col

    def coordinates(self, index: int) -> tuple[int, int, int] | None:
        """``(frame, row, col)`` of a video token on the grid, or `None` for a text token (or one off the grid)."""
        if not 0 <= index < self.seq_len:
            raise ValueError(f"token index {index} is outside the sequence [0, {self.seq_len}).")
        v = index - self.grid_tokens.start
        if not 0 <= v < self.frames * self.frame_tokens:
            return None
        frame, rest = divmod(v, self.frame_tokens)
        row, col = divmod(rest, self.width)
        return (frame, row, col)

    def group_of_token(self, device=None) -> torch.Tensor:
        """Frame group of every token, shape ``(S,)``: 0 for text (wherever it sits), ``f + 1`` for latent
        frame ``f`` (``f`` without text in the sequence). Refused with video tokens off the grid."""
        if self.history_len:
            raise ValueError(
                f"{self.history_len} video tokens of this layout are off the latent grid (history latents, or keyframe and reference tokens): "
                "they belong to no latent frame, so the sequence has no frame groups."
            )
        text = torch.zeros(self.text_len, dtype=torch.long, device=device)
        first = self.text_groups
        video = torch.arange(first, self.frames + first, device=device).repeat_interleave(self.frame_tokens)
        return torch.cat([text, video] if self.text_position == "start" else [video, text])

    def tile_counts(self, tile_shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """Tiles of ``tile_shape`` (latent frames, patch rows, patch columns) along each axis of the grid:
        ``(⌈F / t⌉, ⌈Hp / h⌉, ⌈Wp / w⌉)``, the edge tiles smaller."""
        return tuple(-(-n // size) for n, size in zip(self.grid, tile_shape))

    def tile_of_token(self, tile_shape: tuple[int, int, int], device=None) -> torch.Tensor:
        """Tile group of every token, shape ``(S,)``: 0 for the text (wherever it sits; no text group without
        text), then the video's 3-D tiles of ``tile_shape`` in (t, y, x) row-major order. Refused with video
        tokens off the grid. ``tile_shape=(1, Hp, Wp)`` gives :meth:`group_of_token`."""
        if self.history_len:
            raise ValueError(
                f"{self.history_len} video tokens of this layout are off the latent grid (history latents, or keyframe and reference tokens): "
                "they belong to no tile, so the sequence has no tile groups."
            )
        t, h, w = tile_shape
        _, nh, nw = self.tile_counts(tile_shape)
        f, y, x = (torch.arange(n, device=device) for n in self.grid)
        tile = ((f // t)[:, None, None] * nh + (y // h)[None, :, None]) * nw + (x // w)[None, None, :]
        video = tile.flatten() + self.text_groups
        text = torch.zeros(self.text_len, dtype=torch.long, device=device)
        return torch.cat([text, video] if self.text_position == "start" else [video, text])

    def group_sizes(self) -> list[int]:
        """Tokens in each frame group, in group order: ``[T, Hp·Wp, ..., Hp·Wp]`` (no text entry without text)."""
        return [self.text_len] * self.text_groups + [self.frame_tokens] * self.frames

    # -- latent frames ↔ pixel frames of the decoded video ------------------------------------------
    @property
    def one_grid(self) -> TokenLayout:
        """The layout with one copy of the grid (``grids`` 1): the decoded video's latent frames."""
        return self if self.grids == 1 else dataclasses.replace(self, frames=self.frames // self.grids, grids=1)

    @property
    def default_pixel_frames(self) -> int | None:
        """Frames of the decoded video when the layout alone decides it (F without temporal patches: tc·(F − 1) + 1,
        but for an even F of a 4× VAE); `None` where several video lengths give the same F (temporal patches; an
        even F of a 4× VAE, which CogVideoX decodes to 4F frames and Wan to 4F − 3)."""
        if self.grids > 1:
            return self.one_grid.default_pixel_frames
        if self.clip_latents:
            return self._clips()[-1].stop
        one = self.frames % 2 == 1 or self.temporal_compression != VAE_TEMPORAL  # only a 4× VAE decodes pairs
        causal = one and not self.patch_size_t and self.causal_vae  # Allegro's: the call's count, 4F − 3 … 4F
        return self.temporal_compression * (self.frames - 1) + 1 if causal else None

    def decoded_frames(self, temporal_compression: int | None = None) -> list[int]:
        """Every frame count a decoded video of this layout can have (see :meth:`pixel_frames`)."""
        if self.grids > 1:
            return self.one_grid.decoded_frames(temporal_compression)
        if self.clip_latents:
            return [self._clips(temporal_compression)[-1].stop]
        tc, p = int(temporal_compression or self.temporal_compression), self.patch_size_t or 1
        if not self.causal_vae:  # tc per latent frame from frame 0, the last cropped: at least one of its frames
            return list(range(tc * (self.frames - 1) + 1, tc * self.frames + 1))
        latents = range(p * (self.frames - 1) + 1, p * self.frames + 1)  # those p pads up to F patches
        pairs = {tc * n for n in latents if n % 2 == 0} if tc == VAE_TEMPORAL else set()  # CogVideoX's VAE only
        return sorted({tc * (n - 1) + 1 for n in latents} | pairs)

    def pixel_frames(self, num_pixel_frames: int, temporal_compression: int | None = None) -> list[range]:
        """The decoded pixel frames each latent frame (temporal patch, for CogVideoX 1.5) covers.

        ``N = 4(L - 1) + 1`` pixel frames are ``L`` latent frames: latent frame 0 is pixel frame 0 and latent
        frame ``l ≥ 1`` covers pixel frames ``4(l - 1) + 1 … 4l`` (Wan; CogVideoX with L odd). ``N = 4L``
        with L even is CogVideoX's VAE decoding pairs of latent frames: latent frame ``l`` covers
        ``4l … 4l + 3``. No VAE decodes other counts. Without a causal VAE (``causal_vae=False``, Allegro's) latent
        frame ``l`` covers ``4l … 4l + 3`` whatever L, the last cropped to ``N``. With ``patch_size_t = p`` the
        pipeline pads ``(-L) % p`` latent frames at the start; temporal patch ``k`` covers ``kp … kp + p - 1``.

        Args:
            num_pixel_frames (`int`): frames N of the decoded video (the call's 4k + 1; see :meth:`decoded_frames`).
            temporal_compression (`int | None`): the VAE's ``vae_scale_factor_temporal``; defaults to the layout's.

        Returns:
            `list[range]`: F ranges of pixel-frame indices, in order, together covering ``0 … N - 1``.
        Raises:
            ValueError: no VAE decodes N frames, or N frames are not F latent frames (temporal patches).
        """
        if self.grids > 1:  # each copy of the grid covers the video's frames
            return self.one_grid.pixel_frames(num_pixel_frames, temporal_compression) * self.grids
        n, tc = int(num_pixel_frames), int(temporal_compression or self.temporal_compression)
        if n < 1 or tc < 1:
            raise ValueError(f"num_pixel_frames={num_pixel_frames} and temporal_compression={tc} must be ≥ 1.")
        if self.clip_latents:  # a causal VAE's clips, one after another
            if n != (want := self._clips(tc)[-1].stop):
                raise ValueError(
                    f"this VAE encodes clips of {self.clip_latents} latent frames ({tc * (self.clip_latents - 1) + 1} "
                    f"pixel frames each, the last shorter): F = {self.frames} latent frames are {want} pixel frames, "
                    f"never {n}."
                )
            return self._clips(tc)
        if not self.causal_vae:
            if not tc * (self.frames - 1) < n <= tc * self.frames:
                raise ValueError(
                    f"this VAE decodes {tc} frames per latent frame from frame 0, the last cropped: F = {self.frames} "
                    f"latent frames are {tc * (self.frames - 1) + 1} to {tc * self.frames} pixel frames, never {n}."
                )
            return [range(tc * f, min(tc * (f + 1), n)) for f in range(self.frames)]
        if (n - 1) % tc == 0:
            latent, late = (n - 1) // tc + 1, tc - 1  # frame 0 alone: latent frame l starts tc - 1 frames late
        elif tc == VAE_TEMPORAL and n % (2 * tc) == 0:
            latent, late = n // tc, 0  # CogVideoX's VAE, an even L: tc frames each from frame 0
        else:
            cog = f"(Wan; CogVideoX with L odd) or {tc}L (CogVideoX with L even)" if tc == VAE_TEMPORAL else ""
            raise ValueError(
                f"a decoded video has {tc}L − {tc - 1} frames for L latent frames{' ' + cog if cog else ''}, never {n} frames; the "
                f"pipelines round `num_frames`. Pass the frame count of the decoded video; for this layout "
                f"(F = {self.frames}): {', '.join(map(str, self.decoded_frames(tc)))}."
            )
        p = self.patch_size_t or 1
        padding = (-latent) % p
        if (latent + padding) // p != self.frames:
            what = f"{(latent + padding) // p} temporal patches of {p}" if p > 1 else f"{latent} latent frames"
            raise ValueError(
                f"a video of {n} pixel frames has {what}, but the layout has F = {self.frames}; pass the "
                "number of frames of the video this recording generated."
            )

        def covered(lat: int) -> range:
            return range(max(tc * lat - late, 0), tc * (lat + 1) - late)

        out = []
        for k in range(self.frames):
            lats = [j - padding for j in range(k * p, (k + 1) * p) if j >= padding]
            out.append(range(covered(lats[0]).start, covered(lats[-1]).stop))
        return out

    def _clips(self, temporal_compression: int | None = None) -> list[range]:
        """The pixel frames of each latent frame where a causal VAE encodes clips of ``clip_latents`` on their own:
        per clip, its first latent frame one pixel frame, each later one ``tc``."""
        tc, per = int(temporal_compression or self.temporal_compression), self.clip_latents
        clip = tc * (per - 1) + 1  # pixel frames of a whole clip
        starts = [(f // per) * clip + (0 if f % per == 0 else tc * (f % per) - tc + 1) for f in range(self.frames)]
        return [range(a, a + (1 if f % per == 0 else tc)) for f, a in enumerate(starts)]

    def latent_of_pixel(self, num_pixel_frames: int, temporal_compression: int | None = None) -> list[int]:
        """For each pixel frame of the decoded video, the latent frame (temporal patch) that covers it."""
        ranges = self.one_grid.pixel_frames(num_pixel_frames, temporal_compression)  # in order, covering 0 … N − 1
        return [f for f, frames in enumerate(ranges) for _ in frames]
