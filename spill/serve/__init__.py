"""``spill serve``: OpenAI's HTTP API over one continuously batched generation loop.

``open`` opens the model and its adapters, ``batcher`` runs the engine thread that every
request joins as a row, ``app`` (with ``api``, ``completions``, ``chat``, ``parse``, ``shape``,
``text``) answers HTTP, ``server`` runs uvicorn and stops cleanly. Importing this package
alone imports nothing heavy (the CLI reads ``KEY_ENV`` from it).
"""

KEY_ENV = "SPILL_API_KEY"  # the API key, when --api-key is not given
