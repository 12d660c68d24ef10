"""Tests of ``ac_policies``: activation-checkpointing rules, presets and their reach over model families."""
