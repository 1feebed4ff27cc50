"""`xlaserve bench spec` on the tiny workload (tiny random weights): both systems, identical
greedy outputs, no compile after warm-up, a JSON report; the lookup workload's prompts."""

from __future__ import annotations

import json

from xlaserve.bench.workload import get_workload
from xlaserve.cli import main
from xlaserve.serving.tokenizer import Tokenizer


def test_spec_bench_tiny_single_stream(tiny_llama, tmp_path, capsys) -> None:
    _, ours = tiny_llama
    out = tmp_path / "spec.json"
    rc = main(["bench", "spec", "--model", str(ours), "--workload", "tiny", "--mode", "single",
               "--rounds", "1", "--k", "2", "--ngram-min", "1", "--json", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "TPOT off / on:" in stdout and "mean acceptance length" in stdout
    report = json.loads(out.read_text())
    assert report["identical_outputs"] is True
    assert report["speculative"]["num_speculative_tokens"] == 2
    for name in ("off", "on"):
        assert report[name]["compiles_after_warmup"] == 0
        assert len(report[name]["seconds"]) == 1 and report[name]["median_tpot_ms"] > 0
    assert report["tpot_ratio_off_over_on"] > 0


def test_lookup_workload_repeats_the_start_of_its_text(tiny_llama) -> None:
    _, ours = tiny_llama
    spec = get_workload("lookup")
    work = spec.build(Tokenizer.load(ours), seed=0, num_requests=3)
    for r in work.requests:
        ids = list(r.prompt_token_ids)
        n = next(n for n in range(len(ids)) if n + 1 + n // 4 == len(ids))   # the text
        assert ids[n + 1:] == ids[:n // 4] and spec.prompt_min <= n <= spec.prompt_max
        assert len(ids) + r.num_output_tokens <= spec.max_model_len


def test_spec_bench_draft_model_batch(tiny_llama, tmp_path, capsys) -> None:
    """--method draft: the model's own first layer as the draft, its runner warmed once and
    shared by the passes; outputs identical, nothing compiled after warm-up."""
    _, ours = tiny_llama
    out = tmp_path / "draft.json"
    rc = main(["bench", "spec", "--model", str(ours), "--workload", "tiny", "--mode", "batch",
               "--rounds", "1", "--k", "2", "--method", "draft", "--draft-layers", "1",
               "--json", str(out)])
    assert rc == 0
    assert "mean acceptance length" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["speculative"]["method"] == "draft"
    assert report["speculative"]["draft_layers"] == 1
    assert report["identical_outputs"] is True and report["on"]["num_drafts"] > 0
    assert [report[n]["compiles_after_warmup"] for n in ("off", "on")] == [0, 0]
