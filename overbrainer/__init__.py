"""overbrainer: fine-tuning a language model, declared as a build."""

__version__ = "0.1.0"
