"""Jobs: the verbs' work, engine-free (an engine is reached through its seam).

``tune/`` is ``spill tune``; ``rows/`` the row jobs (run, eval, distill, predict); ``export/``
writes an adapter in other formats; ``track/`` logs a run to its trackers. At the top, what
several share: ``loading`` (a model found and opened), ``preempt`` (one stop per process),
``authority`` (who holds a run), ``group`` and ``launch`` (one job over several processes),
``producer`` (what made a commit), ``adapter_files``, ``inputs`` (JSONL rows), ``schedule``
(the learning rate), and ``chat``."""
