"""The real clients against a live `angelspec serve` app: `text_generation.Client` 0.7.0,
`huggingface_hub.InferenceClient` and the `openai` client on `/v1`. Greedy output through each equals the target's
own greedy decoding (the real engine and an untrained DFly drafter, on a tiny random Llama with the embedded target's
real tokenizer and chat template: `helpers.served_target`)."""

import pytest
import torch
from transformers import LogitsProcessor

pytest.importorskip("fastapi")
text_generation = pytest.importorskip("text_generation")
openai = pytest.importorskip("openai")
from huggingface_hub import InferenceClient  # noqa: E402
from helpers import make_app, reference, served_target  # noqa: E402

from angelspec_hf.tgi_patch.server import running_in_thread  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")  # text_generation 0.7.0 calls it
NEW = 12
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Name three colours."}]
SECOND = "The capital of France is"
PENALISED = dict(repetition_penalty=1.3, frequency_penalty=0.6)  # TGI's /generate has these two
CHAT_PENALISED = dict(frequency_penalty=0.6, presence_penalty=0.8)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency / presence rule over the generated tokens, as a transformers logits processor."""

    def __init__(self, prompt_length, frequency_penalty=0.0, presence_penalty=0.0):
        self.start, self.frequency, self.presence = prompt_length, frequency_penalty, presence_penalty

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids[:, self.start:],
                                                       torch.ones_like(input_ids[:, self.start:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def penalised_reference(input_ids, max_new_tokens, repetition_penalty=1.0, frequency_penalty=0.0,
                        presence_penalty=0.0):
    """The target's own greedy decoding with the same penalties: transformers' `generate` (its repetition penalty
    processor, then OpenAI's rule as a custom processor)."""
    target, _ = served_target()
    extra = OpenAIPenalties(len(input_ids), frequency_penalty, presence_penalty)
    out = target.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                          repetition_penalty=repetition_penalty, logits_processor=[extra])
    return out[0, len(input_ids):].tolist()


@pytest.fixture(scope="module")
def live():
    target, tokenizer = served_target()
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"][0].tolist()
    refs = {"text": reference(tokenizer(PROMPT).input_ids, NEW), "chat": reference(chat_ids, NEW),
            "second": reference(tokenizer(SECOND).input_ids, NEW),
            "text_penalised": penalised_reference(tokenizer(PROMPT).input_ids, 2 * NEW, **PENALISED),
            "chat_penalised": penalised_reference(chat_ids, 2 * NEW, **CHAT_PENALISED)}
    # the penalties change the greedy text, so the tests below can tell whether they were applied
    assert refs["text_penalised"] != reference(tokenizer(PROMPT).input_ids, 2 * NEW)
    assert refs["chat_penalised"] != reference(chat_ids, 2 * NEW)
    texts = {k: tokenizer.decode(v, skip_special_tokens=True) for k, v in refs.items()}
    app, _ = make_app()
    with running_in_thread(app) as url:
        yield url, refs, texts


def test_text_generation_client(live):
    url, refs, texts = live
    client = text_generation.Client(url, timeout=120)
    out = client.generate(PROMPT, max_new_tokens=NEW, decoder_input_details=True)  # always asks for details
    assert [t.id for t in out.details.tokens] == refs["text"] and out.generated_text == texts["text"]
    assert out.details.finish_reason.value in ("length", "eos_token") and out.details.generated_tokens == NEW
    assert len(out.details.prefill) == len(served_target()[1](PROMPT).input_ids)
    stream = list(client.generate_stream(PROMPT, max_new_tokens=NEW))
    assert [r.token.id for r in stream] == refs["text"] and stream[-1].generated_text == texts["text"]
    assert stream[-1].details.generated_tokens == NEW
    with pytest.raises(text_generation.errors.ValidationError, match="max_new_tokens"):
        client.generate(PROMPT, max_new_tokens=10_000)
    with pytest.raises(text_generation.errors.ValidationError, match="repetition_penalty"):
        client.generate(PROMPT, max_new_tokens=2, repetition_penalty=-1.0)
    with pytest.raises(text_generation.errors.ValidationError, match="top_n_tokens"):
        client.generate(PROMPT, max_new_tokens=2, top_n_tokens=6)


def test_penalties_and_top_n_tokens_through_the_text_generation_client(live):
    url, refs, _ = live
    client = text_generation.Client(url, timeout=120)
    out = client.generate(PROMPT, max_new_tokens=2 * NEW, top_n_tokens=3, **PENALISED)
    assert [t.id for t in out.details.tokens] == refs["text_penalised"]
    assert len(out.details.top_tokens) == 2 * NEW
    for token, top in zip(out.details.tokens, out.details.top_tokens):
        assert len(top) == 3 and top[0].id == token.id and abs(top[0].logprob - token.logprob) < 1e-4
        assert top[0].logprob >= top[1].logprob >= top[2].logprob
    stream = list(client.generate_stream(PROMPT, max_new_tokens=2 * NEW, top_n_tokens=2, **PENALISED))
    assert [r.token.id for r in stream] == refs["text_penalised"]
    assert all(len(r.top_tokens) == 2 and r.top_tokens[0].id == r.token.id for r in stream)


def test_huggingface_hub_inference_client(live):
    url, refs, texts = live
    client = InferenceClient(base_url=url, timeout=120)
    assert client.text_generation(PROMPT, max_new_tokens=NEW) == texts["text"]
    details = client.text_generation(PROMPT, max_new_tokens=NEW, details=True)
    assert [t.id for t in details.details.tokens] == refs["text"] and details.generated_text == texts["text"]
    assert "".join(client.text_generation(PROMPT, max_new_tokens=NEW, stream=True)) == texts["text"]
    streamed = list(client.text_generation(PROMPT, max_new_tokens=NEW, stream=True, details=True))
    assert [s.token.id for s in streamed] == refs["text"] and streamed[-1].details.generated_tokens == NEW
    penalised = client.text_generation(PROMPT, max_new_tokens=2 * NEW, details=True, top_n_tokens=2, **PENALISED)
    assert [t.id for t in penalised.details.tokens] == refs["text_penalised"]
    assert [top[0]["id"] for top in penalised.details.top_tokens] == refs["text_penalised"]  # hub: plain dicts

    chat = client.chat_completion(CHAT, max_tokens=NEW, temperature=0)
    assert chat.choices[0].message.content == texts["chat"]
    assert chat.usage.completion_tokens == len(refs["chat"])
    chunks = list(client.chat_completion(CHAT, max_tokens=NEW, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == texts["chat"]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_openai_client(live):
    url, refs, texts = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    out = client.chat.completions.create(model="any", messages=CHAT, max_tokens=NEW, temperature=0, logprobs=True)
    assert out.choices[0].message.content == texts["chat"]
    assert out.choices[0].finish_reason == ("length" if len(refs["chat"]) == NEW else "stop")
    assert len(out.choices[0].logprobs.content) == len(refs["chat"])
    stream = client.chat.completions.create(model="any", messages=CHAT, max_tokens=NEW, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["chat"]
    assert chunks[-1].usage.completion_tokens == len(refs["chat"])
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="any", messages=CHAT, max_tokens=2, n=3)
    sampled = client.chat.completions.create(model="any", messages=CHAT, max_tokens=4, seed=1, temperature=0.7)
    assert sampled.choices[0].message.content == client.chat.completions.create(
        model="any", messages=CHAT, max_tokens=4, seed=1, temperature=0.7).choices[0].message.content


def test_openai_client_penalties_top_logprobs_and_completions(live):
    url, refs, texts = live
    tokenizer = served_target()[1]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="any", messages=CHAT, max_tokens=2 * NEW, temperature=0,
                                          logprobs=True, top_logprobs=2, **CHAT_PENALISED)
    assert chat.choices[0].message.content == tokenizer.decode(refs["chat_penalised"], skip_special_tokens=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(refs["chat_penalised"]) and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == c.logprob for c in content)  # greedy: the chosen token is the top one

    out = client.completions.create(model="any", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == texts["text"]
    assert out.usage.completion_tokens == NEW and out.choices[0].finish_reason == "length"
    both = client.completions.create(model="any", prompt=[PROMPT, SECOND], max_tokens=NEW, temperature=0)
    second = tokenizer.decode(refs["second"], skip_special_tokens=True)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [texts["text"], second]
    chunks = list(client.completions.create(model="any", prompt=[PROMPT, SECOND], max_tokens=NEW, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    for index, want in enumerate([texts["text"], second]):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == want and mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 2 * NEW
    penalised = client.completions.create(model="any", prompt=PROMPT, max_tokens=2 * NEW, temperature=0,
                                          frequency_penalty=0.6, extra_body={"repetition_penalty": 1.3})
    assert penalised.choices[0].text == tokenizer.decode(refs["text_penalised"], skip_special_tokens=True)
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.completions.create(model="any", prompt=[PROMPT] * 5, max_tokens=2)
    assert "max_client_batch_size" in error.value.response.json()["error"]
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.completions.create(model="any", prompt=PROMPT, max_tokens=2, suffix="x")
    assert "suffix" in error.value.response.json()["error"]
