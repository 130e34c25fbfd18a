"""The batch tool under diffusers' context parallelism (a config's ``parallel: {ring: R, ulysses: U}``, under
``torchrun`` or ``accelerate launch``): each generation split over a mesh of R × U processes, prompts in sequence.

The processes are grouped into meshes of R × U consecutive ranks; with more processes than one mesh, the prompts
are dealt out over the meshes as they are over processes without ``parallel``. Every process of a mesh runs every
prompt of its mesh, in one order, which the mesh's first process decides (a prompt complete on disk is skipped)
and sends to the others; that process alone writes (the prompt's folder, its maps, video and previews), as a
recording under context parallelism writes on its rank 0 alone (docs/many-gpus.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..recorder.mesh import CHECKED_FAMILIES
from .config import ConfigError, DumpConfig

__all__ = ["Meshes", "check_parallel", "meshes"]


def check_parallel(cfg: DumpConfig) -> None:
    """``cfg.parallel`` is `None` or ``{ring: R, ulysses: U}`` of positive integers whose product is 2 or more, for
    a family cogattn records under context parallelism, with the stock output call; else `ConfigError`."""
    value = cfg.parallel
    if value is None:
        return
    keys = {"ring", "ulysses"}
    if not isinstance(value, dict) or not value or set(value) - keys:
        raise ConfigError(f"parallel: expected a mapping of ring and ulysses degrees, got {value!r}.")
    for key in keys & set(value):
        if isinstance(value[key], bool) or not isinstance(value[key], int) or value[key] < 1:
            raise ConfigError(f"parallel.{key}: expected a positive integer, got {value[key]!r}.")
    if value.get("ring", 1) * value.get("ulysses", 1) < 2:
        raise ConfigError("parallel: ring × ulysses is 1: leave parallel out to generate on one process.")
    if cfg.family not in CHECKED_FAMILIES:
        raise ConfigError(
            f"parallel: cogattn does not record {cfg.family} under context parallelism yet (checked: "
            f"{', '.join(CHECKED_FAMILIES)})."
        )
    if cfg.capture.layer_output != "stock":
        raise ConfigError(f"parallel: capture.layer_output={cfg.capture.layer_output!r} is refused; use 'stock'.")


@dataclass
class Meshes:
    """This process's place: ``index`` of its mesh among ``count``, its ``rank`` in the mesh, the mesh's ``group``
    and the global rank of its first process (``root``), and the device mesh diffusers takes (``device_mesh``)."""

    index: int
    count: int
    rank: int
    group: object
    root: int
    device_mesh: object
    ring: int
    ulysses: int

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def share(self, prompts: list) -> list:
        """The prompts of this process's mesh: every ``count``-th from its ``index``."""
        return prompts[self.index :: self.count]

    def agree(self, value):
        """The mesh's first process's ``value`` (its prompts to do, its word that a prompt's folder is ready), on every
        process of the mesh: one order and one decision for all."""
        box = [value if self.writer else None]
        dist.broadcast_object_list(box, src=self.root, group=self.group)
        return box[0]

    def enable(self, pipe, experts: tuple[str, ...]) -> None:
        """``enable_parallelism`` on each of the pipeline's transformers, over this process's mesh."""
        from diffusers import ContextParallelConfig

        for name in experts:
            transformer = getattr(pipe, name, None)
            if transformer is not None:
                config = ContextParallelConfig(
                    ring_degree=self.ring, ulysses_degree=self.ulysses, mesh=self.device_mesh
                )
                transformer.enable_parallelism(config=config)


def meshes(cfg: DumpConfig, world: int, rank: int, device: str) -> Meshes:
    """This process's :class:`Meshes` for ``cfg.parallel`` among ``world`` processes (``torch.distributed`` is
    initialised); `ConfigError` where the processes do not make whole meshes."""
    ring, ulysses = cfg.parallel.get("ring", 1), cfg.parallel.get("ulysses", 1)
    size = ring * ulysses
    if world % size:
        raise ConfigError(
            f"parallel: a mesh of ring {ring} × ulysses {ulysses} = {size} processes; {world} processes do not make "
            f"whole meshes (start a multiple of {size})."
        )
    count = world // size
    groups = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(count)]  # every process makes all
    device_type = torch.device(device).type
    names = ("meshes", "ring", "ulysses")
    grid = init_device_mesh(device_type, (count, ring, ulysses), mesh_dim_names=names)
    index = rank // size
    return Meshes(index, count, rank % size, groups[index], index * size, grid["ring", "ulysses"], ring, ulysses)
