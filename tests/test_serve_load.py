"""`benchmarks/serve_load.py`'s pure helpers: request bodies, answer parsing per route, garbled / lost counting
(no server, no model)."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).parents[1] / "benchmarks/serve_load.py")
serve_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_load)

TGI = {"generated_text": " Paris", "details": {"finish_reason": "length", "generated_tokens": 2,
                                               "tokens": [{"id": 7}, {"id": 9}]}}


def _chunk(text, finish=None, chat=True):
    choice = {"index": 0, "finish_reason": finish}
    choice |= {"delta": {"role": "assistant", "content": text}} if chat else {"text": text}
    return json.dumps({"object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]})


def _stream(chat, *texts):
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 2}})
    return [_chunk(t, chat=chat) for t in texts] + [_chunk("", "length", chat), usage, "[DONE]"]


def test_request_bodies_are_greedy_in_each_wire_format():
    assert serve_load.request_body("compat", "p", 4) == {"inputs": "p", "parameters": {"max_new_tokens": 4,
                                                                                        "details": True}}
    chat = serve_load.request_body("chat_stream", "p", 4)
    assert chat["temperature"] == 0 and chat["stream"] and chat["messages"] == [{"role": "user", "content": "p"}]
    assert serve_load.request_body("completions", "p", 4) == {"max_tokens": 4, "temperature": 0, "prompt": "p"}
    jobs = serve_load.jobs_for(list(serve_load.ROUTES), ["a", "b"], 14)
    assert set(jobs) == {(r, p) for r in serve_load.ROUTES for p in "ab"}


def test_parse_answer_per_route():
    assert serve_load.parse_answer("generate", TGI) == {"ids": [7, 9], "text": " Paris", "finish": "length",
                                                        "tokens": 2, "consistent": True}
    assert serve_load.parse_answer("compat", [TGI])["consistent"]
    assert not serve_load.parse_answer("compat", TGI)["consistent"]  # not a list
    events = [{"index": 1, "token": {"id": 7}, "generated_text": None, "details": None},
              {"index": 2, "token": {"id": 9}, "generated_text": " Paris",
               "details": {"finish_reason": "length", "generated_tokens": 2}}]
    data = [json.dumps(e) for e in events]
    assert serve_load.parse_answer("generate_stream", data)["ids"] == [7, 9]
    assert not serve_load.parse_answer("generate_stream", data[::-1])["consistent"]  # wrong indices
    chat = {"object": "chat.completion", "usage": {"completion_tokens": 2},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": " Paris"}, "finish_reason": "stop"}]}
    assert serve_load.parse_answer("chat", chat)["text"] == " Paris"
    for route, chat in (("chat_stream", True), ("completions_stream", False)):
        good = serve_load.parse_answer(route, _stream(chat, " Par", "is"))
        assert good["consistent"] and good["text"] == " Paris" and good["tokens"] == 2, good
        assert not serve_load.parse_answer(route, _stream(chat, " Paris")[:-1])["consistent"]  # no [DONE]
        error = _stream(chat, " P")[:1] + [json.dumps({"error": "boom", "error_type": "generation"}), "[DONE]"]
        assert not serve_load.parse_answer(route, error)["consistent"]
    assert not serve_load.parse_answer("chat", None)["consistent"]  # not JSON: garbled, not a crash


def test_summarise_counts_lost_5xx_and_garbled():
    ref = serve_load.parse_answer("generate", TGI)
    job = ("generate", "p")
    results = [{"ok": True, "status": 200, "latency": 1.0, **ref},
               {"ok": True, "status": 200, "latency": 2.0, **ref, "text": " Lyon"},
               {"ok": False, "status": 500, "error": "boom"}, {"ok": False, "status": None, "error": "reset"}]
    s = serve_load.summarise([(r, job) for r in results], {job: ref})
    assert (s["requests"], s["lost"], s["5xx"], s["garbled"], s["tokens"]) == (4, 2, 1, 1, 4)
    assert s["latency_p99_s"] == 2.0
