"""``spill bundle``: a project, its state and its models as one file, checked and installed
(``bundle`` is the verb; ``format``, ``pack``, ``read``, ``install``, ``models``)."""
