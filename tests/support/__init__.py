"""What several suites share: tiny models and their batches, references, the process pool,
memory and collective-byte counters."""
