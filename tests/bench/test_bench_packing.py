"""`bench packing` per-family table: each family lands in the column its handling says."""

from __future__ import annotations

import argparse


def test_family_table_separates_covered_made_correct_and_refused() -> None:
    from bench.sections.packing.families import family_table

    args = argparse.Namespace(packing_sweep=["llama", "falcon+alibi", "bamba", "rwkv"])
    table, data = family_table(args, "python -m bench --only packing", tick=lambda msg: None)
    verdicts = {row[0]: (row[2], row[3]) for row in table.rows}
    assert verdicts["llama"] == ("covered", "covered")
    assert verdicts["falcon+alibi"] == ("made correct (alibi)",) * 2
    assert verdicts["bamba"] == ("made correct (stateful_mixer)",) * 2
    assert verdicts["rwkv"] == ("refused", "refused")
    for name in ("llama", "falcon+alibi", "bamba"):
        assert data[name]["stock"] > 1e-2 and data[name]["patched"] <= 1e-4, (name, data[name])
    assert "stateful_mixer" in data["rwkv"]["reason"]
    assert any("1 covered, 2 made correct, 1 refused, 0 silent leaks" in note for note in table.notes)
