"""A capture site: one list of blocks whose attentions a family records (docs/design.md, "The model seam").

A :class:`Site` names the blocks, the attribute (or dotted path) of each block's captured attentions and the config key
counting them; ``ModelSpec.sites`` lists a family's sites in execution order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Site", "module_at"]


@dataclass(frozen=True)
class Site:
    """One list of blocks whose attention cogattn captures.

    Args:
        blocks (`str`): attribute of the transformer holding the blocks (a ``ModuleList``), in forward order.
        attention (`str`): attribute of a block holding its self-attention (CogVideoX: the joint text + video
            attention), or its dotted path (Kandinsky 6's ``video_dec_block.self_attention``; ``context``'s and
            ``others``' too); ``context`` itself where that is the only one captured (SANA-Video: linear self-attention).
        context (`str | None`): attribute of a block holding its cross-attention to the text, if any (Wan).
        count_key (`str`): the transformer config's key holding the number of these blocks (or a list of
            one entry per block: Wan VACE's ``vace_layers``).
        others (`tuple[tuple[str, str], ...]`): ``(source, attribute)`` of a block's other captured attentions, each
            its processor told its source (LTX-2's audio stream: ``("audio", "audio_attn1")``, ...).
        count_less (`str`): config key of how many of the list's last blocks are not these (Motif-Video's encoder
            blocks: all but the last ``num_decoder_layers``, its decoder blocks, a site of their own).
        context_key (`str`): config key saying whether these blocks have the ``context`` attention (Motif-Video's
            ``enable_text_cross_attention_single``); empty: every block has it.
        last_of (`str`): config key of the list's length, where these blocks are its last ``count_key`` ones
            (Motif-Video's decoder blocks: the last ``num_decoder_layers`` of ``num_single_layers``); empty: its first.
        layout (`Callable[[TokenLayout], TokenLayout] | None`): these layers' own token layout, made from the
            generation's (``ModelSpec.layer_layouts``), where their attention runs over another sequence; `None`:
            the generation's.
    """

    blocks: str
    attention: str
    context: str | None = None
    count_key: str = "num_layers"
    others: tuple[tuple[str, str], ...] = ()
    count_less: str = ""
    context_key: str = ""
    last_of: str = ""
    layout: Callable | None = None

    def count(self, config: dict) -> int:
        """The number of these blocks in a transformer with ``config`` (but the last ``count_less``)."""
        value = config[self.count_key]
        return (len(value) if isinstance(value, (list, tuple)) else int(value)) - int(config.get(self.count_less) or 0)

    def has_context(self, config: dict) -> bool:
        """Whether these blocks of a transformer with ``config`` have the ``context`` attention."""
        return bool(self.context) and (not self.context_key or bool(config.get(self.context_key)))

    def first(self, config: dict) -> int:
        """The index of these blocks' first in their list (0 but for ``last_of``)."""
        return int(config[self.last_of]) - self.count(config) if self.last_of else 0

    def members(self, transformer):
        """The blocks of ``transformer`` that are capture sites, in forward order (all but the last ``count_less``;
        the last ``count_key`` with ``last_of``)."""
        blocks = getattr(transformer, self.blocks, None) or ()
        if self.count_less or self.last_of:
            first = self.first(transformer.config)
            return blocks[first : first + self.count(transformer.config)]
        return blocks


def module_at(block, path: str):
    """The attribute of ``block`` at ``path``, dotted where it is a submodule's (``video_dec_block.self_attention``)."""
    for name in path.split("."):
        block = getattr(block, name)
    return block
