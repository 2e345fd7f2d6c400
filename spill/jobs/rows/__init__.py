"""The row jobs: ``spill run`` (``generate``), ``eval``, ``distill`` and ``predict``, each a verb
over one driver (``job``: quanta of rows, committed segments, resume, several processes), with
``scoring`` (an answer's log-probability, a choice among labels)."""
