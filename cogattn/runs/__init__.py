"""Run folders: :mod:`~cogattn.runs.folder` names their files and finds them (their lock, the runs under a path),
:mod:`~cogattn.runs.store` writes them (a background writer, atomic record files, the manifest as commit log),
:mod:`~cogattn.runs.run` reads them (``load``, ``Run``), :mod:`~cogattn.runs.schema` and
:mod:`~cogattn.runs.run_values` check their values before use, :mod:`~cogattn.runs.record_file` is one record's
file, and :mod:`~cogattn.runs.skips` what a cache skipped."""
