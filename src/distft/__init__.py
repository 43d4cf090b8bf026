"""distft: finetune Qwen3 on meeting transcripts with every parallel strategy."""

__version__ = "0.1.0"
