"""The OpenAI API through the official client against a real hypercorn server."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.fake_engine import expected_ids, expected_output


def client(srv, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, **kw)


def test_chat_nonstream_matches_hand_computed(make_server, tokenizer):
    srv = make_server()
    msgs = [{"role": "user", "content": "Hello there, how are you?"}]
    r = client(srv).chat.completions.create(model="fake", messages=msgs, max_tokens=5)
    prompt = tokenizer.encode_chat(msgs)
    ids = expected_ids(prompt, 5)
    assert r.choices[0].message.content == tokenizer.decode(ids)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 5
    assert r.model == "fake@1"
    assert srv.state.router.groups[0].replicas[0].engine.blocks_in_use == 0


def test_chat_stream_with_usage(make_server, tokenizer):
    srv = make_server()
    msgs = [{"role": "user", "content": "Count: one two three four five six"}]
    stream = client(srv).chat.completions.create(
        model="fake", messages=msgs, max_tokens=7, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want, finish, count = expected_output(tokenizer, tokenizer.encode_chat(msgs), 7)
    assert finish == "stop" and count == 5  # the reversed template reaches <|im_end|>
    assert text == want
    finals = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    assert finals == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count


def test_completions_stream_and_not(make_server, tokenizer):
    srv = make_server()
    c = client(srv)
    r = c.completions.create(model="fake", prompt="The quick brown fox jumps", max_tokens=4)
    ids = expected_ids(tokenizer.encode("The quick brown fox jumps"), 4)
    assert r.choices[0].text == tokenizer.decode(ids)
    s = "".join(ch.choices[0].text for ch in c.completions.create(
        model="fake", prompt="The quick brown fox jumps", max_tokens=4, stream=True))
    assert s == r.choices[0].text
    # token-id prompt, defaults to 16 tokens
    r2 = c.completions.create(model="fake", prompt=[1000, 2000, 3000])
    assert r2.usage.completion_tokens == 16
    assert r2.choices[0].text == tokenizer.decode(expected_ids([1000, 2000, 3000], 16))


def test_n2_seed_and_stop(make_server, tokenizer):
    srv = make_server()
    msgs = [{"role": "user", "content": "alpha beta gamma delta epsilon"}]
    r = client(srv).chat.completions.create(model="fake", messages=msgs, max_tokens=6, n=2,
                                            seed=20)
    prompt = tokenizer.encode_chat(msgs)
    assert [c.index for c in r.choices] == [0, 1]
    for j, c in enumerate(r.choices):
        assert (c.message.content, c.finish_reason, 6) == expected_output(tokenizer, prompt, 6,
                                                                         20 + j)
    eng = srv.state.router.groups[0].replicas[0].engine
    assert len({q.request_id for q in eng.submitted}) == 2
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 12
    # stop string: cut where it starts, finish_reason stop
    full = tokenizer.decode(expected_ids(prompt, 10, 20))
    stop = full[4:7]
    r = client(srv).chat.completions.create(model="fake", messages=msgs, max_tokens=10,
                                            stop=[stop], seed=20)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_logprobs_shape(make_server):
    srv = make_server()
    r = client(srv).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "one two three"}], max_tokens=3,
        logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert [round(t.logprob, 3) for t in content] == [-0.1, -0.2, -0.3]
    assert all(len(t.top_logprobs) == 2 for t in content)
    r = client(srv).completions.create(model="fake", prompt="one two three", max_tokens=2,
                                       logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 2 and len(lp.token_logprobs) == 2 and len(lp.top_logprobs[0]) == 1
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


def test_models_health_ready_metrics_page(make_server):
    srv = make_server()
    ids = [m.id for m in client(srv).models.list().data]
    assert ids == ["fake", "fake@1"]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert httpx.get(srv.url + "/ready").status_code == 200
    srv.state.router.groups[0].replicas[0].engine.ready = False
    assert httpx.get(srv.url + "/ready").status_code == 503
    srv.state.router.groups[0].replicas[0].engine.ready = True
    client(srv).completions.create(model="fake", prompt="hi there", max_tokens=2)
    m = httpx.get(srv.url + "/metrics").text
    for name in ("xlaserve_time_to_first_token_seconds_bucket", "xlaserve_e2e_request_latency",
                 "xlaserve_kv_cache_usage_perc", "xlaserve_num_requests_running",
                 "xlaserve_prefix_cache_hit_rate", "xlaserve_num_preemptions_total",
                 'xlaserve_generation_tokens_total{model_name="fake@1",tenant="local"} 2.0'):
        assert name in m, name
    page = httpx.get(srv.url + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text


def test_request_id_and_traceparent_propagate(make_server):
    srv = make_server()
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "hi there",
                                                      "max_tokens": 1},
                   headers={"x-request-id": "abc-123", "traceparent": tp})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "abc-123" and r.headers["traceparent"] == tp
    eng = srv.state.router.groups[0].replicas[0].engine
    assert eng.submitted[-1].request_id == "abc-123"
    assert r.json()["id"] == "cmpl-abc-123"


def test_http_metric_endpoint_is_the_route_not_the_path(make_server):
    """Unknown paths, unauthenticated ones included, share one label value: a client cannot
    grow the number of Prometheus series."""
    srv = make_server()
    for i in range(20):
        assert httpx.get(f"{srv.url}/v1/junk-{i}").status_code == 404
    assert httpx.get(srv.url + "/v1/completions").status_code == 405
    client(srv).completions.create(model="fake", prompt="hi there", max_tokens=2)
    assert httpx.get(srv.url + "/health").status_code == 200
    families = text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
    counts = {(s.labels["endpoint"], s.labels["status"]): s.value
              for f in families if f.name == "xlaserve_http_responses"
              for s in f.samples if s.name == "xlaserve_http_responses_total"}
    assert counts == {("unmatched", "404"): 20.0, ("unmatched", "405"): 1.0,
                      ("/v1/completions", "200"): 1.0,
                      ("other", "200"): 2.0}  # /health: LiveServer.start() asked once
