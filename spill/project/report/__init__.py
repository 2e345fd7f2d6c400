"""``spill status`` and ``spill report``: what a state holds, as tables, one HTML file and its
charts (``status``, ``report``, ``html``, ``svg``, ``series``)."""
