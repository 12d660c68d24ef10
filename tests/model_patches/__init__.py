"""Tests of ``model_patches``: the Hugging Face loss paths, sequence packing and the patch registry."""
