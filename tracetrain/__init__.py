"""tracetrain: train and fine-tune Llama-family models fast, and see where time and memory go."""

__version__ = "0.1.0"
