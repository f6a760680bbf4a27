"""Parts shared by the language models: embeddings and the language-module base class."""
