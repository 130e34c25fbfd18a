"""A Griffe extension for the API pages: the docstrings name objects with Sphinx roles (``:func:`record```,
``:mod:`~cogattn.plot.style```), which Markdown would show as written; this renders each as code, the name
alone where the role asks for it (``~``), and takes the quotes off the types of ``Args:`` entries (shown as types)."""

import re

import griffe

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc|const):`(~?)([^`]+)`")
_TYPE = re.compile(r"^(\s*\**\w+ \()`([^`]*)`", re.M)  # "name (`int`, defaults to 1):": the type without its quotes


def _code(match: re.Match) -> str:
    short, name = match.groups()
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


class SphinxRolesAsCode(griffe.Extension):
    """Rewrites Sphinx roles in every docstring Griffe loads as inline code."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _TYPE.sub(r"\1\2", _ROLE.sub(_code, obj.docstring.value))
