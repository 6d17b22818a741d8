"""llm_judge against a loopback OpenAI-compatible server with canned judgements; API keys only where the
server's `judge_api_keys` allow them."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlfabric.reward.scorers import InvalidScorerSpec, build_scorer, run_scorer
from rlfabric.reward.scorers.llm_judge import parse_score, render_template
from rlfabric.reward.scorers.policy import ScorerPolicy

CANNED = {
    "labelled": "The answer is correct but terse.\nScore: 8/10",
    "json": 'Reasoning first. {"score": 7, "why": "ok"}',
    "brackets": "Fine. Rating: [[9]]",
    "bare": "10",
    "garbage": "I cannot decide.",
    "too_high": "Score: 14",
}


class _Judge(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(
            {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
        )
        key = body["messages"][-1]["content"].split("ANSWER:")[1].strip()
        attempts = self.server.attempts
        attempts[key] = attempts.get(key, 0) + 1
        if (key == "flaky" and attempts[key] == 1) or key == "down":
            return self._send(500, {"error": "overloaded"})
        if key == "forbidden":
            return self._send(403, {"error": "no"})
        text = CANNED.get(key, "Score: 5/10")
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.requests, server.attempts = [], {}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def base_url(server):
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def judge(server, policy=None, **params):
    base = {
        "base_url": base_url(server),
        "model": "tiny-judge",
        "template": 'Q: {prompt}\nREF: {reference}\nJSON example: {"score": 3}\nANSWER: {completion}',
        "backoff_s": 0.01,
    }
    return build_scorer("llm_judge", {**base, **params}, policy)


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Score: 7/10", 7.0),
        ("**Score:** 6", 6.0),
        ("[[8]]", 8.0),
        ('{"score": 9}', 9.0),
        ('{"score": "4.5"}', 4.5),
        ("score 3 at first... final Score: 4", 4.0),
        ("3", 3.0),
        ("no score here", None),
        ('{"grade": "A"}', None),
    ],
)
def test_parse_score(text, score):
    assert parse_score(text) == score


def test_template_fills_only_the_named_slots(item):
    rendered = render_template("{prompt}|{completion}|{reference}|{other}", item("c", "r", prompt="p"))
    assert rendered == "p|c|r|{other}"


def test_scores_map_onto_the_unit_interval(judge_server, item):
    keys = ["labelled", "json", "brackets", "bare"]
    results = run_scorer(judge(judge_server), [item(k, "gold", prompt="why?") for k in keys])
    assert [r.status for r in results] == ["ok"] * 4
    assert [r.reward for r in results] == pytest.approx([0.8, 0.7, 0.9, 1.0])
    assert results[0].components == {"judge_score": 8.0}
    request = judge_server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["body"]["model"] == "tiny-judge"
    assert "Q: why?\nREF: gold" in request["body"]["messages"][-1]["content"]


def test_custom_scale(judge_server, item):
    [result] = run_scorer(judge(judge_server, scale_min=1, scale_max=9), [item("labelled")])
    assert result.reward == pytest.approx(7 / 8)


def test_unparseable_or_out_of_scale_judgements_are_errors_not_zero(judge_server, item):
    results = run_scorer(judge(judge_server), [item("garbage"), item("too_high")])
    assert [r.status for r in results] == ["scorer_error", "scorer_error"]
    assert all(math.isnan(r.reward) for r in results)
    assert "no score found" in results[0].message and "outside the scale" in results[1].message


def test_server_error_is_retried_then_succeeds(judge_server, item):
    [result] = run_scorer(judge(judge_server), [item("flaky")])
    assert (result.status, result.reward) == ("ok", 0.5)
    assert judge_server.attempts["flaky"] == 2


def test_persistent_failure_and_client_errors(judge_server, item):
    results = run_scorer(judge(judge_server, max_retries=2), [item("down"), item("forbidden")])
    assert [r.status for r in results] == ["scorer_error", "scorer_error"]
    assert judge_server.attempts == {"down": 3, "forbidden": 1}
    assert "after 3 attempt(s)" in results[0].message and "HTTP 403" in results[1].message


def test_unreachable_endpoint_is_an_error(item):
    scorer = build_scorer(
        "llm_judge", {"base_url": "http://127.0.0.1:9/v1", "model": "m", "max_retries": 1, "backoff_s": 0.01}
    )
    [result] = run_scorer(scorer, [item("x")])
    assert result.status == "scorer_error" and "ConnectError" in result.message


def test_api_key_from_the_named_env_var(judge_server, item, monkeypatch):
    monkeypatch.setenv("RLF_TEST_JUDGE_KEY", "sk-test")
    policy = ScorerPolicy(judge_api_keys={"RLF_TEST_JUDGE_KEY": base_url(judge_server)})
    scorer = judge(judge_server, policy, api_key_env="RLF_TEST_JUDGE_KEY", system_prompt="Be strict.")
    run_scorer(scorer, [item("x")])
    request = judge_server.requests[0]
    assert request["auth"] == "Bearer sk-test"
    assert request["body"]["messages"][0] == {"role": "system", "content": "Be strict."}


def test_many_items_concurrently(judge_server, item):
    results = run_scorer(judge(judge_server, concurrency=4), [item(f"n{i}") for i in range(20)])
    assert [r.reward for r in results] == [0.5] * 20


@pytest.mark.parametrize(
    ("env", "url", "field"),
    [
        ("HOME", "http://127.0.0.1:{port}/v1", "params.api_key_env"),  # not a listed key
        ("RLF_TEST_JUDGE_KEY", "http://attacker.example/v1", "params.base_url"),
        ("RLF_TEST_JUDGE_KEY", "http://127.0.0.1:{port}0/v1", "params.base_url"),  # a prefix, not a path
    ],
)
def test_a_key_goes_only_where_the_server_allows(judge_server, monkeypatch, env, url, field):
    """A caller must not make the service send an environment variable to a URL of its choosing."""
    monkeypatch.setenv("RLF_TEST_JUDGE_KEY", "sk-test")
    policy = ScorerPolicy(judge_api_keys={"RLF_TEST_JUDGE_KEY": base_url(judge_server)})
    port = judge_server.server_address[1]
    with pytest.raises(InvalidScorerSpec) as err:
        judge(judge_server, policy, api_key_env=env, base_url=url.format(port=port))
    assert err.value.field == field
    with pytest.raises(InvalidScorerSpec, match="judge_api_keys"):
        judge(judge_server, api_key_env="RLF_TEST_JUDGE_KEY")  # the default policy lists no key
