"""The recording's bookkeeping around the exact computation: :mod:`~cogattn.recorder.recording` (``record``,
``Recording``: processors and hooks installed and restored), :mod:`~cogattn.recorder.sites` (the capture sites
of a pipeline's transformers), :mod:`~cogattn.recorder.steps` (which denoising step a call is),
:mod:`~cogattn.recorder.guiders` (a modular pipeline's branches), :mod:`~cogattn.recorder.capture` (the calls
handed to :mod:`cogattn.exact`) and :mod:`~cogattn.recorder.processor` (the protocol the families' processors
call)."""
