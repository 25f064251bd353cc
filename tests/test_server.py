"""`angelspec serve` over HTTP: TGI's routes and shapes, validation, overload, disconnects, engine failure and
shutdown, against a live uvicorn server running the real batched engine (an untrained DFly drafter: correctness, not
speed) on a tiny random Llama with the embedded target's real tokenizer (`helpers.served_target`); `angelspec serve`
itself runs on the embedded SmolLM2-135M-Instruct target. The real clients are in `test_server_clients.py`."""

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests


pytest.importorskip("fastapi")
from angelspec_hf.tgi_patch.server import running_in_thread  # noqa: E402
from helpers import MODEL_ID, make_app, reference, served_target  # noqa: E402

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Question: what is 12 * 7?\nAnswer:"]


@pytest.fixture(scope="module")
def live():
    _, tokenizer = served_target()
    refs = {p: reference(tokenizer(p).input_ids, 12) for p in PROMPTS}  # before the engine touches the target
    app, engine = make_app()
    with running_in_thread(app) as url:
        yield url, app.state.server, engine, refs


def post(url, route, body, **kwargs):
    return requests.post(url + route, json=body, timeout=120, **kwargs)


def sse_events(response):
    """The JSON payloads of an SSE response, as TGI's clients read them."""
    return [json.loads(line[5:]) for line in response.iter_lines(decode_unicode=True)
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def wait_until_idle(server, engine, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.worker.in_flight == 0 and engine.num_running == 0 and engine.num_waiting == 0:
            return True
        time.sleep(0.05)
    return False


def assert_serves(url):
    r = post(url, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["generated_text"]


def test_text_stream_detokenises_incrementally_and_cuts_at_stop_strings():
    """No generation: the real tokenizer's ids of a known text, pushed one by one."""
    from angelspec_hf.tgi_patch.server import TextStream

    _, tokenizer = served_target()
    text = "Héllo wörld, naïve café 🙂! The end."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    special = frozenset(tokenizer.all_special_ids)
    plain = TextStream(tokenizer, [], [], special)
    assert "".join(plain.push(i, 0.0)["text"] for i in ids) == text == plain.final_text()
    stream, deltas = TextStream(tokenizer, [], ["café 🙂", "zzz"], special), []
    for i in ids:
        stream.push(i, 0.0)
        deltas.append(stream.openai_delta())
        if stream.stop_span:
            break
    assert stream.final_text() == "Héllo wörld, naïve café 🙂"  # TGI keeps the stop string
    assert stream.final_text(openai=True) == "".join(deltas) == "Héllo wörld, naïve "  # OpenAI drops it


def test_info_health_models_tokenize(live):
    url, server, _, _ = live
    info = requests.get(url + "/info").json()
    assert info["model_id"] == MODEL_ID
    assert (info["max_input_tokens"], info["max_total_tokens"], info["max_stop_sequences"]) == (128, 384, 4)
    assert requests.get(url + "/health").status_code == 200
    assert requests.get(url + "/v1/models").json()["data"][0]["id"] == MODEL_ID
    tokens = post(url, "/tokenize", {"inputs": "Hello world"}).json()
    assert [t["id"] for t in tokens] == server.tokenizer("Hello world").input_ids
    assert "".join(t["text"] for t in tokens) == "Hello world"


def test_concurrent_greedy_requests_are_lossless(live):
    """Three prompts at once (one batch, ragged lengths): each equals the target's own greedy decoding."""
    url, _, _, refs = live
    body = lambda p: {"inputs": p, "parameters": {"max_new_tokens": 12, "details": True,  # noqa: E731
                                                  "decoder_input_details": p == PROMPTS[0]}}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: post(url, "/generate", body(p)), PROMPTS))
    _, tokenizer = served_target()
    for prompt, r in zip(PROMPTS, responses):
        assert r.status_code == 200, r.text
        out = r.json()
        details = out["details"]
        assert [t["id"] for t in details["tokens"]] == refs[prompt]
        assert out["generated_text"] == tokenizer.decode(refs[prompt], skip_special_tokens=True)
        assert details["generated_tokens"] == len(refs[prompt])
        assert details["finish_reason"] == ("length" if len(refs[prompt]) == 12 else "eos_token")
        assert details["seed"] is None  # greedy
        assert all(set(t) == {"id", "text", "logprob", "special"} and t["logprob"] <= 0 for t in details["tokens"])
        if prompt == PROMPTS[0]:
            assert [t["id"] for t in details["prefill"]] == tokenizer(prompt).input_ids
        else:
            assert details["prefill"] == []


def test_compat_route_and_streams(live):
    url, _, _, refs = live
    prompt = PROMPTS[1]
    plain = post(url, "/", {"inputs": prompt, "parameters": {"max_new_tokens": 12}})
    assert isinstance(plain.json(), list) and set(plain.json()[0]) == {"generated_text"}
    full = post(url, "/", {"inputs": prompt, "parameters": {"max_new_tokens": 12, "return_full_text": True}})
    assert full.json()[0]["generated_text"] == prompt + plain.json()[0]["generated_text"]
    for route, body in [("/generate_stream", {"inputs": prompt, "parameters": {"max_new_tokens": 12}}),
                        ("/", {"inputs": prompt, "stream": True, "parameters": {"max_new_tokens": 12}})]:
        r = post(url, route, body, stream=True)
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
        assert [e["index"] for e in events] == list(range(1, len(events) + 1))
        assert [e["token"]["id"] for e in events] == refs[prompt]
        assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
        last = events[-1]
        assert last["generated_text"] == plain.json()[0]["generated_text"]
        assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == last["generated_text"]
        assert last["details"]["generated_tokens"] == len(events)


def test_stop_sequence_cuts_the_text_and_frees_the_slot(live):
    url, server, engine, refs = live
    _, tokenizer = served_target()
    full_text = tokenizer.decode(refs[PROMPTS[0]], skip_special_tokens=True)
    stop = full_text.strip().split()[2]  # a word a few tokens in
    r = post(url, "/generate", {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 12, "details": True,
                                                                      "stop": ["never-there", stop]}})
    out = r.json()
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert out["generated_text"].endswith(stop) and full_text.startswith(out["generated_text"])  # TGI keeps the stop
    assert out["details"]["generated_tokens"] < len(refs[PROMPTS[0]])
    messages = [{"role": "user", "content": "Say hello"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    chat_text = tokenizer.decode(reference(chat_ids, 12), skip_special_tokens=True)
    chat_stop = chat_text.split()[2]
    chat = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0,
                                              "stop": chat_stop})  # OpenAI drops it
    content = chat.json()["choices"][0]["message"]["content"]
    assert chat.json()["choices"][0]["finish_reason"] == "stop"
    assert chat_stop not in content and chat_text.startswith(content + chat_stop)
    assert wait_until_idle(server, engine)


@pytest.mark.parametrize("body,needle", [
    ("{not json", "JSON"),
    ([1, 2], "body"),
    ({"parameters": {"max_new_tokens": 4}}, "inputs"),
    ({"inputs": "", "parameters": {"max_new_tokens": 4}}, "cannot be empty"),
    ({"inputs": "\x16", "parameters": {"max_new_tokens": 4}}, "it has no tokens"),  # the tokenizer drops it
    ({"inputs": 7}, "inputs"),
    ({"inputs": "Hi", "parameters": {"max_new_tokens": "4"}}, "max_new_tokens"),
    ({"inputs": "Hi", "parameters": {"do_sample": "yes"}}, "do_sample"),
    ({"inputs": "Hi", "parameters": {"max_new_tokens": 10**9}}, "must be <= 384"),
    ({"inputs": "Hi", "parameters": {"max_new_tokens": 0}}, "strictly positive"),
    ({"inputs": "Hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}, "up to 4 stop sequences"),
    ({"inputs": "Hi", "parameters": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"inputs": "Hi", "parameters": {"frequency_penalty": 2.5}}, "frequency_penalty"),
    ({"inputs": "Hi", "parameters": {"top_n_tokens": 6}}, "top_n_tokens"),
    ({"inputs": "Hi", "parameters": {"typical_p": 0.5}}, "typical_p"),
    ({"inputs": "Hi", "parameters": {"temperature": 0}}, "temperature"),
    ({"inputs": "Hi", "parameters": {"top_k": 0}}, "top_k"),
    ({"inputs": "Hi", "parameters": {"temperature": float("inf")}}, "finite"),  # json.dumps writes Infinity
    ('{"inputs": "\\ud800 hi"}', "valid Unicode"),  # a lone surrogate: JSON can say it, no tokenizer can encode it
    ({"inputs": "word " * 200, "parameters": {"max_new_tokens": 4}}, "less than 128 tokens"),
])
def test_bad_input_gets_tgi_error_and_server_keeps_serving(live, body, needle):
    url, _, _, _ = live
    data = body if isinstance(body, str) else json.dumps(body)
    for route in ("/generate", "/generate_stream"):
        r = requests.post(url + route, data=data, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "validation" and needle in r.json()["error"]
    bad_chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2})
    assert bad_chat.status_code == 422 and bad_chat.json()["error_type"] == "validation"
    assert requests.get(url + "/health").status_code == 200


def test_extreme_sampling_parameters_are_served(live):
    """Parameters that once failed every request in flight: a top-k past int64 and a temperature so small that
    dividing by it overflowed (NaN probabilities). Now: the first keeps every token, the second is the argmax."""
    url, _, _, _ = live
    greedy = post(url, "/generate", {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 6}}).json()
    tiny = post(url, "/generate", {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 6, "do_sample": True,
                                                                         "temperature": 1e-39, "seed": 1}})
    assert tiny.status_code == 200 and tiny.json()["generated_text"] == greedy["generated_text"]
    huge = post(url, "/generate", {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 6, "top_k": 2**63,
                                                                         "seed": 1}})
    assert huge.status_code == 200 and huge.json()["generated_text"]
    parts = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}],
                                               "max_tokens": 2})
    assert parts.status_code == 422 and parts.json()["error_type"] == "validation"
    surrogate = requests.post(url + "/tokenize", data='{"inputs": "\\ud800"}',
                              headers={"Content-Type": "application/json"}, timeout=60)
    assert surrogate.status_code == 422 and "valid Unicode" in surrogate.json()["error"]


def test_seeded_sampling_is_reproducible(live):
    url, _, _, _ = live
    body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 8, "do_sample": True, "seed": 3, "top_k": 20,
                                                 "temperature": 0.8, "details": True}}
    a, b = post(url, "/generate", body).json(), post(url, "/generate", body).json()
    ids = lambda out: [t["id"] for t in out["details"]["tokens"]]  # noqa: E731  (log-probs may differ in the ulp)
    assert a["generated_text"] == b["generated_text"] and ids(a) == ids(b) and a["details"]["seed"] == 3
    implied = post(url, "/generate", {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 2, "top_p": 0.9,
                                                                            "details": True}}).json()
    assert implied["details"]["seed"] is not None  # TGI samples when a warper is set, and reports the seed


def _open_raw_stream(url, max_new_tokens):
    """A streaming request over a raw socket; returns the socket once the first token event arrived."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"inputs": PROMPTS[0], "parameters": {"max_new_tokens": max_new_tokens}}).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    seen = b""
    while b"data:" not in seen:
        seen += sock.recv(4096)
    return sock


@pytest.fixture
def slow_steps(live, monkeypatch):
    """Engine steps of at least 20 ms, as on a real model: the tiny served model would finish 300 tokens before the
    disconnect tests below could leave."""
    engine, real_step = live[2], live[2].step

    def step():
        time.sleep(0.02)
        return real_step()

    monkeypatch.setattr(engine, "step", step)


def test_overload_429_and_abrupt_disconnects_cancel(live, slow_steps):
    """Six streams fill `max_concurrent_requests`: a seventh request gets 429. The six clients then vanish (RST);
    their requests are cancelled in the engine at the next step, long before their 300 tokens."""
    url, server, engine, _ = live
    socks = [_open_raw_stream(url, 300) for _ in range(6)]
    r = post(url, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 429 and r.json()["error_type"] == "overloaded"
    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        sock.close()
    assert wait_until_idle(server, engine), (server.worker.in_flight, engine.num_running)
    assert engine.totals["tokens"] < 6 * 300
    assert_serves(url)


def test_client_that_closes_a_stream_cancels_its_request(live, slow_steps):
    url, server, engine, _ = live
    r = post(url, "/generate_stream", {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 300}}, stream=True)
    lines = r.iter_lines()
    assert next(line for line in lines if line.startswith(b"data:"))
    r.close()
    assert wait_until_idle(server, engine)
    assert_serves(url)


def test_clients_that_leave_non_streaming_requests_cancel_them(live, slow_steps):
    """Six non-streaming requests (`/generate`, `/` and chat) fill every slot, then their clients give up (a 1.5 s
    read timeout closes the socket): each request is cancelled in the engine and its slot freed within seconds, long
    before its 300 tokens, and the metrics count them as 499 (client closed request)."""
    url, server, engine, _ = live
    tokens_before = engine.totals["tokens"]
    bodies = [("/generate", {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 300}}),
              ("/", {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 300}}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 500."}], "max_tokens": 300,
                                        "temperature": 0})] * 2

    def leave(route_body):
        with pytest.raises(requests.ReadTimeout):
            requests.post(url + route_body[0], json=route_body[1], timeout=(5, 1.5))

    with ThreadPoolExecutor(len(bodies)) as pool:
        list(pool.map(leave, bodies))
    assert wait_until_idle(server, engine, timeout=5), (server.worker.in_flight, engine.num_running)
    assert engine.totals["tokens"] - tokens_before < 6 * 300
    assert_serves(url)
    text = requests.get(url + "/metrics").text
    for route in ("/generate", "/", "/v1/chat/completions"):
        assert f'angelspec_requests_total{{route="{route}",status="499"}} 2.0' in text


def test_engine_failure_is_424_and_the_next_request_succeeds(live, monkeypatch):
    url, server, engine, _ = live
    real_step, failures = engine.step, []

    def failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("injected engine failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_once)
    r = post(url, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 424 and r.json() == {"error": "Request failed during generation: injected engine failure",
                                                 "error_type": "generation"}
    assert_serves(url)
    assert wait_until_idle(server, engine)


HOSTILE = [  # (parameters of the bad request, the status it gets): floats that vanish or overflow as float32
    ({"do_sample": True, "temperature": 1e-46}, 422), ({"do_sample": True, "temperature": 5e-324}, 422),
    ({"repetition_penalty": 5e-324}, 422), ({"repetition_penalty": 1e39}, 422), ({"top_p": 1e-46}, 422),
    ({"do_sample": True, "temperature": 1e39, "seed": 5}, 200), ({"do_sample": True, "temperature": 3.5e38}, 200),
    ({"repetition_penalty": 1e-45}, 200), ({"do_sample": True, "temperature": 9e-46}, 422), ({"seed": 2**64 - 1, "do_sample": True}, 200), ({"seed": 2**70, "do_sample": True}, 200),
    ({"seed": -1}, 422),
]


def _victims(url):
    """Four greedy chats and a stream at once (what a bad request must not hurt): their texts, or the error."""
    chats = [{"messages": [{"role": "user", "content": p}], "max_tokens": 10, "temperature": 0} for p in PROMPTS]
    chats.append({"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 10, "temperature": 0})

    def chat(body):
        r = post(url, "/v1/chat/completions", body)
        return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text

    def stream():
        r = post(url, "/generate_stream", {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 40}}, stream=True)
        events = sse_events(r)
        return r.status_code, [e.get("token", {}).get("id") if "error" not in e else e for e in events]

    return [lambda b=b: chat(b) for b in chats] + [stream]


def test_a_hostile_value_fails_no_other_request(live):
    """Each edge value beside four chats and a stream: the victims all get 200 and the tokens of a clean run; the bad
    request gets TGI's 422 or a correct answer; nobody gets a 424."""
    url, _, _, _ = live
    with ThreadPoolExecutor(5) as pool:
        clean = list(pool.map(lambda f: f(), _victims(url)))
    assert all(status == 200 for status, _ in clean), clean
    for parameters, status in HOSTILE:
        bad = lambda: post(url, "/generate", {"inputs": PROMPTS[0], "parameters": {  # noqa: E731
            "max_new_tokens": 12, "details": True, **parameters}})
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(f) for f in _victims(url)]
            answer = pool.submit(bad).result()
            victims = [f.result() for f in futures]
        assert victims == clean, parameters
        assert answer.status_code == status, (parameters, answer.text)
        if status == 422:
            assert answer.json()["error_type"] == "validation"
        else:
            tokens = answer.json()["details"]["tokens"]
            assert tokens and all(math.isfinite(t["logprob"]) for t in tokens)
            if "seed" in parameters:
                assert answer.json()["details"]["seed"] == parameters["seed"]


def test_a_step_that_fails_for_one_request_fails_it_alone(live, monkeypatch):
    """A fault inside the engine's step that only one request triggers (injected into its sampling): that request
    gets 424, the four chats and the stream beside it finish with the tokens of a clean run."""
    url, server, engine, _ = live
    with ThreadPoolExecutor(5) as pool:
        clean = list(pool.map(lambda f: f(), _victims(url)))
    real = engine._process

    def process(logits, requests, span):
        if any(r.params.do_sample and r.params.top_k == 17 for r in requests):
            raise RuntimeError("injected fault of one request")
        return real(logits, requests, span)

    monkeypatch.setattr(engine, "_process", process)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(f) for f in _victims(url)]
        answer = pool.submit(post, url, "/generate", {"inputs": PROMPTS[1], "parameters": {
            "max_new_tokens": 30, "do_sample": True, "top_k": 17, "seed": 1}}).result()
        victims = [f.result() for f in futures]
    assert answer.status_code == 424 and "injected fault of one request" in answer.json()["error"]
    assert victims == clean
    assert wait_until_idle(server, engine)
    assert_serves(url)


def test_openai_defaults_and_bounds(live):
    """`/v1/completions` without `max_tokens` stops at OpenAI's 16; `top_logprobs` and `logit_bias` are held to
    their schema whatever `logprobs` says; a chat temperature that is 0 as a float32 is greedy."""
    url, _, _, _ = live
    r = post(url, "/v1/completions", {"prompt": "Once upon a time", "temperature": 0, "stop": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    long = post(url, "/v1/completions", {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 40})
    assert long.json()["usage"]["completion_tokens"] > 16 or long.json()["choices"][0]["finish_reason"] == "stop"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for extra in ({"top_logprobs": -1}, {"top_logprobs": 6, "logprobs": False}, {"logit_bias": False},
                  {"logit_bias": {"5": 1}}, {"logit_bias": []}, {"temperature": -1.0},
                  {"temperature": 0, "top_p": 0}):
        bad = post(url, "/v1/chat/completions", chat | extra)
        assert bad.status_code == 422 and bad.json()["error_type"] == "validation", extra
    for extra in ({"logit_bias": {}}, {"logit_bias": None}, {"top_logprobs": 0}):
        assert post(url, "/v1/chat/completions", chat | extra).status_code == 200, extra
    greedy = post(url, "/v1/chat/completions", chat | {"temperature": 0, "max_tokens": 8}).json()
    tiny = post(url, "/v1/chat/completions", chat | {"temperature": 1e-46, "max_tokens": 8}).json()
    assert tiny["choices"][0]["message"] == greedy["choices"][0]["message"]


def test_metrics(live):
    url, _, _, _ = live
    text = requests.get(url + "/metrics").text
    assert 'angelspec_requests_total{route="/generate",status="200"}' in text
    assert 'angelspec_requests_total{route="/generate",status="422"}' in text
    for name in ("angelspec_request_duration_seconds_bucket", "angelspec_queue_size", "angelspec_batch_size_bucket",
                 "angelspec_accepted_length_bucket", "angelspec_verify_budget_bucket",
                 "angelspec_pruned_draft_tokens_bucket", "angelspec_cost_model_choice_total"):
        assert name in text, name


def test_small_load_loses_and_garbles_nothing():
    """`benchmarks/serve_load.py` at small scale: 16 concurrent clients, 32 greedy requests (half streamed), each
    answer equal to the same prompt's answer alone; resident memory grows < 10 % after a warm-up round."""
    psutil = pytest.importorskip("psutil")
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).parents[1] / "benchmarks/serve_load.py")
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)
    app, _ = make_app(max_concurrent_requests=32)
    process = psutil.Process()
    with running_in_thread(app) as url:
        report = serve_load.run_load(url, clients=16, requests_total=32, max_new_tokens=6,
                                     prompts=serve_load.PROMPTS[:4], rss=lambda: process.memory_info().rss)
    assert report["lost"] == 0 and report["garbled"] == 0, report
    assert report["rss_growth_pct"] < 10, report


def test_graceful_shutdown_finishes_in_flight_requests():
    """Shutting the server down while a stream runs: the stream completes, then the engine thread stops."""
    app, engine = make_app(drafter=False)
    server = app.state.server
    events = []
    with running_in_thread(app) as url:
        r = post(url, "/generate_stream", {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 10}}, stream=True)
        reader = threading.Thread(target=lambda: events.extend(sse_events(r)))
        reader.start()
        while not engine.totals["tokens"]:
            time.sleep(0.02)
    reader.join(30)
    assert events and events[-1]["details"]["finish_reason"] in ("length", "eos_token")
    assert not server.worker.alive and not engine.has_work()


@pytest.mark.parametrize("flag, value", [("--kv-cache-tokens", "0"), ("--max-batch-size", "-3"),
                                         ("--kv-cache-tokens", "many")])
def test_cli_serve_refuses_bad_sizes_before_loading_anything(flag, value, capsys):
    from angelspec_hf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", flag, value])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert flag in err and ("at least 1" in err or "expected an integer" in err), err
    assert "loading target" not in out


def test_cli_serve_refuses_a_lookup_corpus_without_replies_before_loading_anything(tmp_path, capsys):
    from angelspec_hf.cli import main

    assert main(["serve", "--lookup-corpus", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "--lookup-corpus" in err and "holds no lookup corpus" in err and "loading target" not in out, err


def test_cli_serve_refuses_a_corpus_window_past_its_bound_before_loading_anything(capsys):
    from angelspec_hf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--corpus-window-tokens", str((1 << 20) + 1)])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert "--corpus-window-tokens" in err and "at most 1048576" in err and "loading target" not in out, err


def test_serve_gives_the_drafter_its_lookup_corpus(tmp_path):
    """`--lookup-corpus <regenerated replies>`: the served engine looks up in it beside each request's context (for
    a drafter whose config has lookups off, they are turned on), and the log says how many tokens it holds; 'none'
    leaves the context alone."""
    from angelspec_hf.tgi_patch.engine import EngineConfig
    from angelspec_hf.tgi_patch.server import build_app
    from angelspec_hf.tgi_patch.server.config import ServeConfig
    from helpers import tiny_chat_target, tiny_drafter

    target, tokenizer = tiny_chat_target()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    tiny_drafter("dfly", target, lookup_tokens=0).save_pretrained(tmp_path / "drafter")
    (tmp_path / "replies").mkdir()
    (tmp_path / "replies" / "mine.jsonl").write_text(json.dumps({"id": "0", "response_ids": [5, 6, 7]}) + "\n")
    seen = {}
    for corpus in (str(tmp_path / "replies"), "none"):
        config = ServeConfig(target=str(tmp_path / "target"), drafter=str(tmp_path / "drafter"), threads=1,
                             linear_kernels="stock", lookup_corpus=corpus, engine=EngineConfig(verify="full"))
        lines = []
        app, engine = build_app(config, log=lines.append)
        seen[corpus] = engine.policy.corpus, "\n".join(lines), engine.policy.lookup_tokens
    corpus, log, lookup_tokens = seen[str(tmp_path / "replies")]
    assert corpus is not None and len(corpus) == 3 and "corpus of 1 earlier replies (3 tokens)" in log
    assert lookup_tokens == 10
    assert seen["none"][0] is None and "corpus" not in seen["none"][1] and seen["none"][2] == 0
    # --corpus-window-tokens: the corpus also grows with the replies served
    from angelspec_hf.policy import GrowingCorpus

    config = ServeConfig(target=str(tmp_path / "target"), drafter=str(tmp_path / "drafter"), threads=1,
                         linear_kernels="stock", lookup_corpus=str(tmp_path / "replies"),
                         engine=EngineConfig(verify="full", corpus_window_tokens=64))
    lines = []
    _, engine = build_app(config, log=lines.append)
    assert isinstance(engine.policy.corpus, GrowingCorpus) and len(engine.policy.corpus.base) == 3
    assert "also in the replies served, their last 64 tokens" in "\n".join(lines)


@pytest.mark.real_model
def test_cli_serve_and_sigint_mid_stream():
    """`angelspec serve` in its own process: it serves, and on SIGINT the open stream still completes before the
    process exits cleanly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "angelspec_hf.cli", "serve", "--port", str(port), "--verify", "depth:2",
           "--threads", "1", "--max-batch-size", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.5)
        info = requests.get(url + "/info").json()["angelspec"]
        assert info["verify"] == "depth:2" and (info["device"], info["dtype"]) == ("cpu", "float32")  # --device auto
        r = post(url, "/generate_stream", {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 12}}, stream=True)
        lines = r.iter_lines(decode_unicode=True)
        first = next(line for line in lines if line.startswith("data:"))
        proc.send_signal(signal.SIGINT)
        events = [json.loads(first[5:])] + [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert events[-1]["details"]["finish_reason"] in ("length", "eos_token")
        assert len(events) == events[-1]["details"]["generated_tokens"]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert "Application shutdown complete" in output
