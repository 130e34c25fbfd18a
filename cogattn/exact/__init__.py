"""The exact computation: a layer call's attention probabilities formed in tiles within the memory budget and
folded into each kind's result. :mod:`~cogattn.exact.planner` sizes the tiles (with
:mod:`~cogattn.exact.memory`'s model of their bytes), :mod:`~cogattn.exact.engine` runs the passes of
:mod:`~cogattn.exact.passes` (fused calls in :mod:`~cogattn.exact.attention`, the Triton kernel in
:mod:`~cogattn.exact.kernels`, cross-attention in :mod:`~cogattn.exact.context`), the reducers of
:mod:`~cogattn.exact.reducers` fold them (token patterns from :mod:`~cogattn.exact.patterns`), and
:mod:`~cogattn.exact.checks` spot-checks what a fast method made. Nothing here knows a pipeline or a run folder's
bookkeeping: that is :mod:`cogattn.recorder` and :mod:`cogattn.runs`."""
