"""``cogattn-dump``: generate with a pipeline of a family cogattn knows (CogVideoX, Wan, HunyuanVideo, ...)
for many prompts and save the attention maps.

Run it as the console script ``cogattn-dump``, as ``python -m cogattn.dump``, or from a checkout as
``python scripts/dump_maps.py``; ``cogattn-dump -h`` says how. Modules:

* :mod:`~cogattn.dump.config`: the YAML config (:class:`~cogattn.dump.config.DumpConfig`, with the
  capture options as a :class:`cogattn.CaptureOptions`) and the shipped default config;
* :mod:`~cogattn.dump.rules`: the rules of the config's pipeline call, from the model's family spec;
* :mod:`~cogattn.dump.prompts`: the prompts file;
* :mod:`~cogattn.dump.cli`: the command: checks, the dry-run plan, the loop over prompts;
* :mod:`~cogattn.dump.generate`: the pipeline and one prompt's generation with capture;
* :mod:`~cogattn.dump.previews`: preview images of a prompt's maps.

The shipped configs and prompts (the repository's top-level ``configs/`` folder) are package data,
installed as ``cogattn.dump.configs``.
"""

from .cli import main

__all__ = ["main"]
