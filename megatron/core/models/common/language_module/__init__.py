"""The base class of language models (loss and tied embeddings)."""
