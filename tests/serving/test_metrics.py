"""/metrics' speculative-decoding families from an engine's stats: vLLM's spec_decode counter
names under xlaserve_, and the acceptance-length histogram built from its counts."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from xlaserve.serving.engine_api import EngineStats, ServiceCosts
from xlaserve.serving.metrics import Metrics


class StatsOnly:
    """An engine as the collector sees it: stats and costs, here set by hand."""

    def __init__(self, stats: EngineStats):
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats

    def service_costs(self) -> ServiceCosts:
        return ServiceCosts()


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("xlaserve_spec_decode")}


def test_spec_counters_and_acceptance_histogram() -> None:
    # 10 verify rows: 3 accepted nothing, 2 one draft, 5 all four; 22 of 40 drafts accepted
    stats = EngineStats(spec_num_drafts=10, spec_num_draft_tokens=40,
                        spec_num_accepted_tokens=22, spec_acceptance_counts=(3, 2, 0, 0, 5))
    got = samples(Metrics(lambda: [("m@1", "r0", StatsOnly(stats))]))
    assert got[("xlaserve_spec_decode_num_drafts_total", ())] == 10
    assert got[("xlaserve_spec_decode_num_draft_tokens_total", ())] == 40
    assert got[("xlaserve_spec_decode_num_accepted_tokens_total", ())] == 22
    h = "xlaserve_spec_decode_acceptance_length"
    buckets = [got[(h + "_bucket", (("le", le),))] for le in ("1", "2", "3", "4", "5", "+Inf")]
    assert buckets == [3, 5, 5, 5, 10, 10]
    assert got[(h + "_count", ())] == 10 and got[(h + "_sum", ())] == 32   # 10 rows + 22


def test_no_speculation_no_histogram_sample() -> None:
    got = samples(Metrics(lambda: [("m@1", "r0", StatsOnly(EngineStats()))]))
    assert got[("xlaserve_spec_decode_num_drafts_total", ())] == 0
    assert not any(name.startswith("xlaserve_spec_decode_acceptance") for name, _ in got)
