"""The shipped configs and prompts of ``cogattn-dump``: this folder is package data of ``cogattn.dump``,
installed as ``cogattn.dump.configs`` (see ``[tool.setuptools]`` in pyproject.toml); no Python here."""
