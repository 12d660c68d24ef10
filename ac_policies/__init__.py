"""Activation checkpointing expressed as declarative predicate tables over module names."""

__all__: list[str] = []
