"""editrain: EDiT / A-EDiT local-SGD training for large language models on FSDP2."""

__version__ = "0.1.0"
