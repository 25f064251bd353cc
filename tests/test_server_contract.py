"""The server's contract with any client, however bad its request: bounded work, TGI-shaped errors for every input
(no 500, no `{"detail": ...}`), an event loop that keeps answering, and an OpenAPI schema that tells the truth,
checked by a bounded schemathesis run. A live uvicorn server over real HTTP, on a tiny random Llama with the embedded
target's real tokenizer and chat template (fast: the behaviour under test is the server's, not the model's)."""

import http.client
import json
import socket
import threading
import time

import pytest
import requests
import torch
from helpers import tiny_chat_target

pytest.importorskip("fastapi")
from angelspec_hf.tgi_patch.engine import SpeculativeEngine  # noqa: E402
from angelspec_hf.tgi_patch.server import TextStream, create_app, running_in_thread  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def live():
    torch.set_num_threads(1)
    target, tokenizer = tiny_chat_target()
    engine = SpeculativeEngine(target, None, verify="full", max_batch_size=4)
    # room for the chat template's default system prompt (~30 tokens); small enough that every request is quick
    app = create_app(engine, tokenizer, "tiny", max_input_tokens=96, max_total_tokens=112, max_concurrent_requests=4)
    with running_in_thread(app) as url:
        yield url, app, tokenizer


def raw(url, data: bytes, route="/generate", headers=None):
    return requests.post(url + route, data=data, headers={"Content-Type": "application/json"} | (headers or {}),
                         timeout=60)


def assert_tgi_error(r, status, error_type, needle=""):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json", r.headers
    assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == error_type, r.text
    assert needle in r.json()["error"], r.text


# ---------------------------------------------------------------- every error TGI-shaped
@pytest.mark.parametrize("data,status,needle", [
    (b"{not json", 422, "malformed JSON"),
    (b'{"inputs": "\xff\xfe hi"}', 400, "utf-8"),  # invalid UTF-8
    (b"[" * 100_000, 400, "recursion"),  # JSON nested 100k levels deep
    (b'{"inputs": "hi", "parameters": {"grammar": ' + b"[" * 900 + b"]" * 900 + b"}}", 422, "grammar"),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": 2.5}}', 422, "max_new_tokens"),
])
def test_unparseable_bodies_get_tgi_errors(live, data, status, needle):
    url, _, _ = live
    for route in ("/generate", "/generate_stream", "/", "/v1/chat/completions", "/tokenize"):
        if route in ("/v1/chat/completions", "/tokenize") and needle in ("grammar", "max_new_tokens"):
            continue
        assert_tgi_error(raw(url, data, route), status, "validation", needle)
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_unknown_routes_methods_and_oversized_bodies_get_tgi_errors(live):
    url, _, _ = live
    assert_tgi_error(requests.get(url + "/nope", timeout=5), 404, "not_found")
    assert_tgi_error(requests.post(url + "/v1/nope", json={}, timeout=5), 404, "not_found")
    r = requests.get(url + "/generate", timeout=5)
    assert_tgi_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    assert_tgi_error(requests.delete(url + "/health", timeout=5), 405, "method_not_allowed")
    # a body declared over the 2 MB payload limit is refused before it is read (the client sends only headers)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 3000000\r\n\r\n{")
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 413
        assert json.loads(response.read()) == {"error": "Input validation error: the request body is larger than "
                                               "the payload limit of 2000000 bytes", "error_type": "validation"}
    # a chunked body (no declared length) is cut as soon as it passes the limit
    chunks = (b"x" * 65536 for _ in range(40))
    assert_tgi_error(raw(url, chunks), 413, "validation", "2000000 bytes")
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_values_the_schema_allows_are_served(live):
    """What the schema calls valid is not refused: integral floats, an empty role, no content, a text
    `response_format`; what it calls invalid (`response_format: {}`) is a 422."""
    url, _, _ = live
    r = requests.post(url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2.0, "seed": 1.0,
                                                                               "do_sample": True}}, timeout=60)
    assert r.status_code == 200, r.text
    for extra in ({"messages": [{"role": "", "content": "Hi"}]}, {"messages": [{"role": "user", "content": None}]},
                  {"response_format": {"type": "text"}}, {"temperature": 0, "max_tokens": 2.0}):
        r = requests.post(url + "/v1/chat/completions", json=CHAT | extra, timeout=60)
        assert r.status_code == 200, (extra, r.text)
    assert_tgi_error(requests.post(url + "/v1/chat/completions", json=CHAT | {"response_format": {}}, timeout=60),
                     422, "validation", "response_format")


# ---------------------------------------------------------------- bounded work
def test_stop_strings_are_bounded_in_count_and_length(live):
    url, _, _ = live
    info = requests.get(url + "/info", timeout=5).json()
    assert (info["max_stop_sequences"], info["max_stop_length"]) == (4, 256)
    ok = requests.post(url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2,
                                                                                "stop": ["x" * 256] * 4}}, timeout=60)
    assert ok.status_code == 200, ok.text
    for stop, needle in ((["a"] * 5, "up to 4 stop sequences"), (["x" * 257], "at most 256 characters")):
        assert_tgi_error(requests.post(url + "/generate", json={"inputs": "Hi", "parameters": {"stop": stop}},
                                       timeout=60), 422, "validation", needle)
        assert_tgi_error(requests.post(url + "/v1/chat/completions", json=CHAT | {"stop": stop}, timeout=60),
                         422, "validation", needle)


def test_stop_matching_is_windowed_and_equals_a_full_search(live):
    """Stops split over many tokens, overlapping, or not there: after every token, the stop found equals a search of
    the whole text so far (the first stop to complete, the earliest if several complete in one token), while each
    token is searched only in a window of the longest stop (minus one) plus its own text."""
    _, _, tokenizer = live
    text = "alpha beta gamma delta, épsilon zêta 🙂 eta theta; iota kappa lambda mu nu xi omicron pi rho " * 3
    ids = tokenizer(text, add_special_tokens=False).input_ids
    special = frozenset(tokenizer.all_special_ids)
    for stops in (["mu nu xi omicron"], ["zzz", "🙂 eta", "theta"], ["theta; iota kappa lambda", "kappa"],
                  ["rho alpha beta", "omicron pi rho " * 2], ["not there", "x" * 256]):
        stream, seen, longest = TextStream(tokenizer, [], stops, special), "", max(map(len, stops))
        for i in ids:
            token = stream.push(i, 0.0)
            seen += token["text"]
            hits = [(seen.find(s), seen.find(s) + len(s)) for s in stops if s in seen]
            assert stream.stop_span == (min(hits) if hits else None), (stops, seen)
            assert len(stream._window) <= longest - 1
            if stream.stop_span:
                assert stream.final_text() == seen[:stream.stop_span[1]]
                assert stream.final_text(openai=True) == seen[:stream.stop_span[0]]
                break
        assert stream.stop_span or stops[0] == "not there"


def test_health_answers_within_a_second_while_heavy_requests_are_served(live):
    """Tokenizing a prompt just under the 2 MB payload limit and templating a chat of 12k messages each take seconds
    of CPU here; they run off the event loop, so `/health` keeps answering fast (the requests end in a 422: too
    many tokens)."""
    url, _, _ = live
    heavy = [("/generate", {"inputs": "hello world, " * 150_000, "parameters": {"stop": ["x" * 256] * 4}}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 20}] * 12_000})]
    for route, body in heavy:
        done = {}
        worker = threading.Thread(target=lambda: done.update(r=requests.post(url + route, json=body, timeout=60)))
        worker.start()
        latencies = []
        while worker.is_alive():
            start = time.perf_counter()
            assert requests.get(url + "/health", timeout=1).status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
        worker.join()
        assert_tgi_error(done["r"], 422, "validation", "must have less than 96 tokens")
        assert len(latencies) >= 3 and max(latencies) < 1.0, latencies  # the request took a while; health did not


# ---------------------------------------------------------------- a truthful schema
def test_openapi_documents_what_the_server_does(live):
    url, _, _ = live
    spec = requests.get(url + "/openapi.json", timeout=5).json()
    paths, schemas = spec["paths"], spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # FastAPI's `{"detail": ...}`, which this server never sends
    health = paths["/health"]["get"]["responses"]
    assert "content" not in health["200"] and "ErrorResponse" in json.dumps(health["503"])  # 200: empty body
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert list(paths["/generate_stream"]["post"]["responses"]["200"]["content"]) == ["text/event-stream"]
    for route in ("/", "/v1/chat/completions"):
        assert set(paths[route]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for route in ("/generate", "/generate_stream", "/", "/v1/chat/completions"):
        responses = paths[route]["post"]["responses"]
        for status in ("400", "413", "422", "424", "429"):
            assert responses[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}, (route, status)
    params = schemas["GenerateParameters"]["properties"]
    assert {"minimum": 1} .items() <= params["max_new_tokens"]["anyOf"][0].items()
    assert {"minimum": 1e-45, "maximum": 1}.items() <= params["top_p"]["anyOf"][0].items()
    assert {"minimum": 1e-45}.items() <= params["temperature"]["anyOf"][0].items()
    assert {"minimum": 1e-45, "maximum": 3.4e38}.items() <= params["repetition_penalty"]["anyOf"][0].items()
    assert params["seed"]["anyOf"][0] == {"type": "integer", "minimum": 0}  # any u64 and beyond: modulo 2**64
    assert params["max_new_tokens"]["anyOf"][0]["maximum"] == 111 and params["truncate"]["anyOf"][0]["maximum"] == 96
    assert params["stop"]["maxItems"] == 4 and params["stop"]["items"]["maxLength"] == 256
    assert schemas["GenerateRequest"]["properties"]["inputs"]["minLength"] == 1


# A 422 for a schema-valid request is a failure (positive data acceptance) except for the limits no JSON schema can
# state: a prompt's length in tokens, alone or with the new tokens, or a non-empty prompt with no tokens (e.g. "\x16",
# which the tokenizer drops; the schema states every other bound).
TOKEN_COUNT_LIMITS = ("must have less than", "`inputs` tokens + `max_new_tokens` must be <=", "it has no tokens")


def run_schemathesis(url: str, max_examples: int) -> tuple[list[str], int]:
    """Every documented operation, with valid and (where there is a body) invalid requests, under every check
    schemathesis has (as `--checks all`); returns the failures and the number of requests sent."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import CHECKS, load_all_checks
    from schemathesis.core.failures import FailureGroup

    load_all_checks()
    checks = CHECKS.get_all()
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failures, sent = [], 0
    for operation in (result.ok() for result in schema.get_all_operations()):
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.body else [])
        for mode in modes:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def check(case):
                nonlocal sent
                response = case.call(base_url=url, timeout=30)
                sent += 1
                if response.status_code == 422 and any(limit in response.text for limit in TOKEN_COUNT_LIMITS):
                    return
                try:
                    case.validate_response(response, checks=checks)
                except FailureGroup as exc:  # keep them all, not only the first
                    failures.append(f"{operation.label} ({mode.value}): {exc}")

            check()
    return failures, sent


def test_schemathesis_finds_the_schema_truthful(live):
    """Bounded (a few examples per operation and mode, ~20 s here): no 5xx, and every status, content type and
    body is one the schema documents."""
    pytest.importorskip("schemathesis")
    url, _, _ = live
    failures, sent = run_schemathesis(url, max_examples=8)
    assert not failures, "\n\n".join(failures[:5])
    assert sent >= 60


def test_schemathesis_run_can_fail(live):
    """The same run against a server whose schema lies (`/info` claims a field it never sends) fails."""
    pytest.importorskip("schemathesis")
    url, app, _ = live
    info = app.openapi()["components"]["schemas"]["Info"]
    info["required"].append("never_sent")
    try:
        failures, _ = run_schemathesis(url, max_examples=1)
    finally:
        info["required"].remove("never_sent")
    assert any(f.startswith("GET /info") and "never_sent" in f for f in failures), failures
