"""What a bake reads, made ready for training: conversations, the base model, and whether
the training fits the machine.

``conversations.py``  conversation files → validated, split ``examples.parquet``
``base_model.py``     a base model (folder, GGUF, hub id, alias) → a local HF folder in the cache
``sizing.py``         the memory a training step needs, against what the device has
"""
