"""Version-gated registries of Hugging Face Transformers patches."""

__all__: list[str] = []
