"""What a bake reads, made ready for training: conversations, the base model, and whether
the training fits the machine.

``sources.py``        the plan's data entries → files (globs, folders, ``save_to_disk``, hub cache)
``readers.py``        rows out of JSON Lines, JSON, Parquet, CSV/TSV and Arrow files, by file:line
``formats.py``        a row → messages (openai, sharegpt, prompt/completion, alpaca, ``fields``)
``mixing.py``         weights and ``rows`` caps, deterministic from the seed
``conversations.py``  validated conversations → the split ``examples.parquet``
``templates.py``      chat templates for bases without one
``base_model.py``     a base model (folder, GGUF, hub id, alias): named and pinned
``base_cache.py``     a base model made local: imported once into the shared cache
``sizing.py``         the memory a training step needs, against what the device has
"""
