"""Hugging Face checkpoints in and out: ``--import-hf`` and ``--export-hf`` (convert.py), one
name and config table per model family (families.py). transformers reads config.json and
tokenizers; safetensors moves the tensors; the training path never imports either."""
