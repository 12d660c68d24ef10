"""`bench train`: the context search, the data, the loss check, and the section end to end at tiny widths."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.sections.train.context import Budget, longest_fitting, parse_budget
from bench.sections.train.data import (
    DISTRIBUTION,
    LengthDistribution,
    context_documents,
    padded_batch,
    real_tokens,
    scored_tokens,
    step_documents,
)
from bench.sections.train.variant_table import loss_agreement

TINY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


# ---- the context search, on synthetic memory curves ------------------------------------------

@given(static=st.integers(0, 10**6), per_token=st.integers(1, 4000), quadratic=st.integers(0, 3),
       budget=st.integers(1, 10**8), start=st.sampled_from([64, 256]), limit=st.sampled_from([1024, 5000, 65536]))
def test_longest_fitting_finds_the_measured_boundary(static, per_token, quadratic, budget, start, limit):
    def memory(n: int) -> int:
        return static + per_token * n + quadratic * n * n

    asked: list[int] = []

    def fits(n: int) -> bool:
        asked.append(n)
        return memory(n) <= budget

    s = longest_fitting(fits, start, limit, granularity=64)
    assert [n for n, _ in s.probes] == asked
    assert all(start <= n <= limit for n in asked)
    truth = max((n for n in range(start, limit + 1) if memory(n) <= budget), default=None)
    if truth is None:
        assert s.longest is None and s.probes == ((start, False),)
        return
    # never extrapolated: the answer was itself measured and fitted
    assert (s.longest, True) in s.probes
    assert s.longest <= truth
    if s.at_limit:
        assert s.longest == limit == truth
    else:
        # the first length above it that was measured did not fit, within the search's resolution
        misses = [n for n, ok in s.probes if not ok and n > s.longest]
        assert misses and min(misses) - s.longest <= max(64, 0.25 * s.longest)
        assert truth - s.longest <= max(64, 0.25 * s.longest)


def test_longest_fitting_doubles_then_bisects():
    # memory crosses the budget between 1000 and 1001 tokens
    s = longest_fitting(lambda n: n <= 1000, 128, 16384, granularity=64, tolerance=0.0)
    assert [n for n, _ in s.probes][:5] == [128, 256, 512, 1024, 768]
    assert s.longest == 960 and not s.at_limit


def test_longest_fitting_refuses_bad_bounds():
    with pytest.raises(ValueError, match="start <= limit"):
        longest_fitting(lambda n: True, 512, 256, 64)
    with pytest.raises(ValueError, match="granularity"):
        longest_fitting(lambda n: True, 64, 256, 0)


def test_parse_budget():
    assert parse_budget("+1GiB") == Budget(2**30, above_static=True)
    assert parse_budget("6GB") == Budget(6 * 10**9, above_static=False)
    assert parse_budget("512MiB").limit_above_static(100 * 2**20) == 412 * 2**20
    assert parse_budget("+1GiB").limit_above_static(10**12) == 2**30
    for bad in ("", "lots", "-1GiB", "0MiB", "3 parsecs"):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


# ---- the documents ---------------------------------------------------------------------------

def test_length_distribution_has_its_documented_statistics():
    s = DISTRIBUTION.stats(max_len=10**6, n=50000)
    assert s["median"] == pytest.approx(64, rel=0.05)
    assert s["mean"] == pytest.approx(105, rel=0.05)  # 64 e^(1/2)
    assert s["p90"] == pytest.approx(230, rel=0.06)
    assert s["p99"] == pytest.approx(655, rel=0.12)
    clipped = DISTRIBUTION.stats(max_len=128)
    assert clipped["p90"] == 128 and 0.15 < clipped["clipped"] < 0.35
    assert "median 64" in DISTRIBUTION.describe(256)
    assert DISTRIBUTION.draw(50, 256, seed=3) == DISTRIBUTION.draw(50, 256, seed=3)
    assert min(LengthDistribution(minimum=8).draw(2000, 256, 0)) >= 8


def test_padded_and_packed_layouts_score_the_same_tokens():
    from bench.sections.train.data import packed_batch

    for docs in step_documents(steps=4, docs_per_step=5, max_len=128, vocab=1000, seed=1):
        padded = padded_batch(docs)
        packed = packed_batch(docs, 128, require_packing=False)
        assert real_tokens(padded) == real_tokens(packed) == sum(map(len, docs))
        assert scored_tokens(padded) == scored_tokens(packed) == sum(len(d) - 1 for d in docs)
        assert padded["input_ids"].shape == (5, max(map(len, docs)))


def test_context_documents_warm_up_on_a_short_first_step():
    steps = context_documents(3, 500, vocab=1000, seed=2, warmup=64)
    assert [len(g[0]) for g in steps] == [64, 500, 500] and all(len(g) == 1 for g in steps)
    assert [len(g[0]) for g in context_documents(2, 100, vocab=1000)] == [100, 100]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        context_documents(2, 100, vocab=1000, warmup=1)


def test_loss_agreement_flags_a_curve_off_by_more_than_round_off():
    ref = [12.0, 11.5, 11.0]
    assert loss_agreement(ref, [12.0, 11.5 + 1e-6, 11.0], 1e-4) == (pytest.approx(1e-6), True)
    diff, ok = loss_agreement(ref, [12.0, 11.5, 10.9], 1e-4)
    assert not ok and diff == pytest.approx(0.1)
    with pytest.raises(ValueError, match="different lengths"):
        loss_agreement(ref, ref[:2], 1e-4)


# ---- judging and reporting, on synthetic run figures ----------------------------------------

MIB = 2**20


def _fake_run(tokens_per_s: float, peak_mib: float, phase: str = "backward") -> dict:
    static = {"params": 100 * MIB, "grads": 100 * MIB, "optimizer": 200 * MIB}
    phases = {p: {"peak": (peak_mib + 100) * MIB if p == phase else 50 * MIB, "held": 0, "reserved": None,
                  "seconds": 1.0} for p in ("forward", "backward", "optimizer")}
    return {"tokens_per_s": tokens_per_s, "peak_above_static": peak_mib * MIB, "peak_phase": phase,
            "phases": phases, "static": static, "kept_after_forward": 10 * MIB, "losses": [1.0, 0.9]}


def test_each_variant_is_compared_with_stock_of_the_same_checkpointing_and_trainer():
    from bench.sections.train.variant_table import VARIANTS, loss_reference, same_checkpointing

    every = list(VARIANTS)
    assert same_checkpointing("hidden_loss", every) == "stock"
    assert same_checkpointing("hidden_loss+hf_gc", every) == "stock+hf_gc"
    assert same_checkpointing("all", every) == "stock+hf_gc"
    assert same_checkpointing("sft:hidden_loss", every) == "sft"
    assert same_checkpointing("sft:all", every) == "sft+hf_gc"
    assert same_checkpointing("sft:all", ["stock+hf_gc", "sft:all"]) is None  # never across trainers
    assert loss_reference(["all", "sft", "stock+hf_gc"]) == "stock+hf_gc"
    assert loss_reference(["sft:all", "sft+hf_gc"]) == "sft+hf_gc"


def test_variants_leave_out_sft_trainer_without_trl(monkeypatch, caplog):
    import bench.sections.train.variant_table as tv

    monkeypatch.setattr(tv, "trl_available", lambda: False)
    assert tv.variants_for(["stock", "sft", "sft:all", "ac:non_moe"], "dense") == ["stock"]
    assert "SFTTrainer variants sft, sft:all are left out" in caplog.text
    monkeypatch.setattr(tv, "trl_available", lambda: True)
    assert tv.variants_for(["stock", "sft", "ac:non_moe"], "moe") == ["stock", "sft", "ac:non_moe"]
    with pytest.raises(ValueError, match="unknown train variant 'nope'"):
        tv.variants_for(["nope"], "dense")


def test_comparison_table_pairs_one_change_and_judges_the_targets():
    from bench.sections.train.compare import comparison_table

    results = {"stock": _fake_run(100, 1000), "hidden_loss": _fake_run(120, 400), "packing": _fake_run(125, 900),
               "stock+hf_gc": _fake_run(80, 800), "all": {"error": "killed"}}
    agree = {"stock": True, "hidden_loss": True, "packing": False, "stock+hf_gc": True}
    table = comparison_table("m", results, agree, "cmd")
    rows = {r[0]: r for r in table.rows}
    col = {c: i for i, c in enumerate(table.columns)}
    assert set(rows) == {"hidden-state loss", "packing, Transformers' loss"}  # pairs where one side is missing: none
    hidden = rows["hidden-state loss"]
    assert hidden[col["x (tokens/s)"]] == pytest.approx(1.2)
    assert hidden[col["x (peak above static)"]] == pytest.approx(0.4)
    assert hidden[col["target (tokens/s)"]].startswith("met (1.20x")
    packing = rows["packing, Transformers' loss"]
    assert packing[col["target (tokens/s)"]].startswith("NOT met (1.25x; target >= 1.3x")
    assert packing[col["losses agree (both)"]] == "NO"
    assert comparison_table("m", {"stock": _fake_run(1, 1)}, {}, "cmd") is None


def test_what_holds_the_peak_names_the_phase_and_its_parts():
    from bench.sections.train.meter import phase_peaks, what_holds

    r = _fake_run(1.0, 600, "backward")
    assert phase_peaks(r) == "50 / 700 / 50"
    assert what_holds(r).startswith("backward: gradients (100 MiB) + 600 MiB")
    assert what_holds(_fake_run(1.0, 600, "optimizer")).startswith("optimizer step")
    assert what_holds({}) == "-" and phase_peaks({}) == "- / - / -"


def test_longest_context_table_searches_both_and_compares_at_stocks_longest(monkeypatch):
    """The context table on a fake worker: stock costs 2 MiB a token, the library 0.1 MiB, both
    +600 MiB; a 1 GiB budget fits 212 and 4240 tokens."""
    import bench.sections.train.longest as tl

    asked = []

    def fake_run_variant(spec, timeout, cache=None):
        tokens = spec["data"]["context"]
        assert spec["data"]["steps"] == 2 and spec["data"]["warmup"] == min(tl.WARMUP_TOKENS, tokens)
        library = spec["variant"]["hidden_loss"]
        asked.append(("library" if library else "stock", tokens))
        return _fake_run(10.0, 600 + tokens * (0.1 if library else 2.0))

    monkeypatch.setattr(tl, "run_variant", fake_run_variant)
    args = argparse.Namespace(train_budget="+1GiB", train_context_limit=8192, train_timeout=60.0)
    table, data = tl.longest_context_table(args, "m", 1, lambda v, d: {"variant": vars(v), "data": d}, "cmd",
                                           tick=lambda msg: None)
    stock, library = data["searches"]["stock+hf_gc"], data["searches"]["library"]
    assert 212 - 64 <= stock["longest"] <= 212 and 4240 * 0.75 <= library["longest"] <= 4240
    assert not library["at_limit"]
    assert data["context_ratio"] == pytest.approx(library["longest"] / stock["longest"])
    # at stock's longest: (600 + 0.1 n) / (600 + 2 n)
    n = stock["longest"]
    assert data["peak_ratio_at_stock_longest"] == pytest.approx((600 + 0.1 * n) / (600 + 2 * n))
    assert [r[1] for r in table.rows] == ["stock+hf_gc", "library", f"stock+hf_gc at stock's longest ({n})",
                                          f"library at stock's longest ({n})"]
    assert any(note.startswith("target: the library's longest context >= 4x stock's: met") for note in table.notes)
    assert any("<= 0.5x stock's: NOT met" in note for note in table.notes)
    assert len(asked) == len(set(asked))  # every probe measured once


# ---- whole runs at tiny widths (each variant a process of ~10 s) -----------------------------

def _spec(variant: dict, steps: int = 5) -> dict:
    return {"model": "qwen3-0.6b", "layers": 2, "overrides": TINY, "variant": variant, "device": "cpu",
            "dtype": "fp32", "lr": 1e-3, "seed": 0, "data": {"steps": steps, "docs_per_step": 3, "row_len": 64}}


@pytest.mark.slow  # four training processes, about a minute on 2 cores
def test_loss_check_fails_on_a_deliberately_wrong_variant():
    from bench.sections.train.variant_table import run_variant

    stock = run_variant(_spec({}), timeout=600)
    library = run_variant(_spec({"packing": True, "hidden_loss": True, "policy": "full"}), timeout=600)
    assert loss_agreement(stock["losses"], library["losses"], 1e-4)[1], (stock["losses"], library["losses"])
    for wrong in ("lr", "drop_token"):
        bad = run_variant(_spec({"wrong": wrong}), timeout=600)
        assert "error" not in bad, bad
        diff, ok = loss_agreement(stock["losses"], bad["losses"], 1e-4)
        assert not ok, (wrong, diff)


@pytest.mark.slow  # four training processes, about a minute on 2 cores
def test_sft_trainer_variants_train_to_the_trainer_losses():
    """SFTTrainer with TRL's padding, with PackingCollator, and with everything on: the same
    documents per step and the same losses as transformers.Trainer's stock run."""
    pytest.importorskip("trl")
    from bench.sections.train.variant_table import run_variant

    stock = run_variant(_spec({}), timeout=600)
    for variant in ({"trainer": "sft"}, {"trainer": "sft", "packing": True},
                    {"trainer": "sft", "packing": True, "hidden_loss": True, "policy": "full"}):
        r = run_variant(_spec(variant), timeout=600)
        assert "error" not in r, (variant, r)
        assert r["real_tokens"] == stock["real_tokens"] and r["scored_tokens"] == stock["scored_tokens"], variant
        assert loss_agreement(stock["losses"], r["losses"], 1e-4)[1], (variant, stock["losses"], r["losses"])


@pytest.mark.slow  # about ten training processes at tiny widths: a couple of minutes on 2 cores
def test_bench_train_section_end_to_end():
    from bench.sections.train import section as train

    args = argparse.Namespace(
        device="cpu", full=False, train_full=False, train_models=["qwen3-0.6b", "qwen3-30b-a3b"],
        train_variants=["stock", "stock+hf_gc", "ac:non_moe", "all"], train_layers=2, train_steps=5, train_docs=2,
        train_row=64, train_lr=1e-3, train_context="on", train_context_models=["qwen3-0.6b"],
        train_budget="+4MiB", train_context_limit=512, train_timeout=600.0, train_dtype=None,
        train_overrides=json.dumps(TINY), dtype=None,
    )
    assert train.count(args) > 0
    section = train.run(args, tick=lambda msg: None)
    titles = [t.title for t in section.tables]
    assert titles[0].startswith("train: qwen3-0.6b") and any("qwen3-30b-a3b" in t for t in titles)
    dense = section.tables[0]
    col = {c: i for i, c in enumerate(dense.columns)}
    assert [r[0] for r in dense.rows] == ["stock", "stock+hf_gc", "all"]  # non_moe only on the MoE model
    for row in dense.rows:
        assert row[col["status"]] == "ok", row
        assert row[col["losses agree"]] == "yes", row
        assert row[col["peak phase"]] in ("forward", "backward", "optimizer")
        assert row[col["real tokens/s"]] > 0
    moe = next(t for t in section.tables if t.title.startswith("train: qwen3-30b-a3b, 2"))
    assert "ac:non_moe" in [r[0] for r in moe.rows]
    runs = section.data["models"]["qwen3-0.6b"]
    assert runs["all"]["real_tokens"] == runs["stock"]["real_tokens"]  # packed: the same documents
    assert all(s >= t for s, t in zip(runs["all"]["slots"], runs["all"]["real_tokens"]))
    context = section.tables[-1]
    assert context.title.startswith("train: longest context")
    searches = section.data["context"]["qwen3-0.6b"]["searches"]
    for name, s in searches.items():
        assert s["probes"], name
        if s["longest"] is not None:
            assert [s["longest"], True] in [list(p) for p in s["probes"]]


def test_planned_context_table_checks_each_answer_with_measured_steps(monkeypatch):
    """The planned-context table on fake workers: each plan's answer and its too-long length are
    measured, the estimate's error printed beside them, the ratio of the answers in the notes."""
    import bench.sections.train.planned as tp

    answers = {"stock+hf_gc": (1000, 1200), "library": (9000, 11000), tp.PEER: (6000, 7000)}
    measured = []
    monkeypatch.setattr(tp, "deepspeed_tiling_available", lambda: True)

    def fake_call(target, spec, timeout):
        if target is tp.search_worker:
            tokens, too_long = answers[spec["plan"]]
            return {"static": 100 * MIB, "budget": 100 * MIB + spec["above_static"], "tokens": tokens,
                    "too_long": too_long, "peak": 1000 * MIB, "over_peak": 1200 * MIB, "limit": "activations",
                    "seconds": 3.0}
        measured.append((spec["plan"], spec["tokens"]))
        fits = spec["tokens"] == answers[spec["plan"]][0]
        return {"measured": (1050 if fits else 1250) * MIB, "estimated": 1100 * MIB, "static": 100 * MIB,
                "seconds": 2.0, "phase": "backward", "module": "model.layers.3.mlp"}

    monkeypatch.setattr(tp.isolated, "call", fake_call)
    table, data = tp.planned_context_table("qwen3-0.6b", None, "bfloat16", "cmd", 60.0, tick=lambda m: None,
                                           above_static=1024 * MIB, check_lengths=(2048,))
    assert sorted(measured) == [(tp.PEER, 2048), ("library", 2048), ("stock+hf_gc", 1000), ("stock+hf_gc", 1200)]
    assert [r[:3] for r in table.rows] == [["stock+hf_gc", "fits", 1000], ["stock+hf_gc", "too long", 1200],
                                           ["library", "fits", 9000], ["library", "too long", 11000],
                                           ["library", "check", 2048], [tp.PEER, "fits", 6000],
                                           [tp.PEER, "too long", 7000], [tp.PEER, "check", 2048]]
    assert table.rows[4][3] == 1000 and table.rows[4][5] == f"{(1100 - 1250) / 1250:+.1%}"
    assert table.rows[0][5] == f"{(1000 - 1050) / 1050:+.1%}" and table.rows[0][6] == "yes"
    assert table.rows[1][6] == "no"
    assert any("9.00x (target >= 8x)" in note for note in table.notes)
    assert any(f"{tp.PEER} / stock: 6.00x; library / {tp.PEER}: 1.50x" in note for note in table.notes)

    # without DeepSpeed the peer's rows are left out, and the notes say so
    monkeypatch.setattr(tp, "deepspeed_tiling_available", lambda: False)
    measured.clear()
    table, data = tp.planned_context_table("qwen3-0.6b", None, "bfloat16", "cmd", 60.0, tick=lambda m: None,
                                           above_static=1024 * MIB, check_lengths=(2048,))
    assert tp.PEER not in data and all(r[0] != tp.PEER for r in table.rows)
    assert any("not run: DeepSpeed is not installed" in note for note in table.notes)


def test_headline_table_compares_the_library_with_stock_at_one_length(monkeypatch):
    import bench.sections.train.headline as th

    seen = []

    def fake_run_variant(spec, timeout, cache=None):
        seen.append((spec["variant"]["policy"], spec["data"]))
        return _fake_run(12.0, 750.0) if spec["variant"]["hidden_loss"] else _fake_run(10.0, 1000.0)

    monkeypatch.setattr(th, "run_variant", fake_run_variant)
    table, results = th.headline_table("qwen3-0.6b", 28, 2048, 3, "fp32",
                                       lambda v, d: {"variant": vars(v), "data": d}, "cmd", 60.0, lambda m: None)
    assert [p for p, _ in seen] == [None, "long_context"]
    assert all(d == {"steps": 3, "context": 2048, "warmup": th.WARMUP_TOKENS} for _, d in seen)
    stock, library = table.rows
    assert library[2] == pytest.approx(1.2) and library[4] == pytest.approx(0.75) and library[6] == "yes"
    assert "28 layers" in table.title


def test_projection_table_searches_each_placement(monkeypatch):
    """Stock, the library and the peer on one device (the library and the peer with parameters in
    host memory, or bf16 weights and gradients on the device with AdamW off it: 8B only) and on 8
    with FSDP2, and the library with the sequence sharded over the 8 too; the spec each search gets
    says where everything is."""
    import bench.sections.train.planned as tp

    specs = []

    def fake_call(target, spec, timeout):
        assert target is tp.search_worker
        specs.append(spec)
        return {"tokens": 4096, "too_long": 4352, "too_long_predicted": spec["plan"] == "library",
                "limit": "activations"}

    monkeypatch.setattr(tp.isolated, "call", fake_call)
    monkeypatch.setattr(tp, "deepspeed_tiling_available", lambda: True)
    table, data = tp.projection_table("cmd", 60.0, tick=lambda m: None)
    # 30B has no on-device case; only the library shards the sequence (one row per model)
    assert len(specs) == len(table.rows) == len(data) == 3 + 2 + 3 + 3 + 3 + 2
    sharded = [s for s in specs if s["context_parallel"] > 1]
    assert {(s["plan"], s["world_size"], s["context_parallel"]) for s in sharded} == {("library", 8, 8)}
    on_device = [s for s in specs if s["optimizer"] is None]
    assert {(s["model"], s["plan"]) for s in on_device} == {("llama3.1-8b", "library"), ("llama3.1-8b", tp.PEER)}
    assert not any(s["offload_params"] for s in on_device)
    host = [s for s in specs if s["offload_params"]]
    assert {s["plan"] for s in host} == {"library", tp.PEER} and all(s["world_size"] == 1 for s in host)
    assert all(r[3].endswith("checkpoints offloaded") == (r[2] == "library") for r in table.rows)
    assert {r[6] for r in table.rows} == {"predicted", "traced"}
    monkeypatch.setattr(tp, "deepspeed_tiling_available", lambda: False)
    assert len(tp.projection_searches()) == 2 + 1 + 2 + 2 + 2 + 2
