"""Tests of ``functional_ce``: the chunked cross-entropy, hidden-state and token losses, alone and vocabulary-parallel."""
