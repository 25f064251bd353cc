"""The real clients against a live `angelspec serve` app: `text_generation.Client` 0.7.0,
`huggingface_hub.InferenceClient` and the `openai` client on `/v1`. Greedy output through each equals the target's
own greedy decoding (the real engine, the embedded target and an untrained DFly drafter)."""

import pytest

pytest.importorskip("fastapi")
text_generation = pytest.importorskip("text_generation")
openai = pytest.importorskip("openai")
from huggingface_hub import InferenceClient  # noqa: E402
from test_server import make_app, real_target, reference  # noqa: E402  (shares the session's loaded target)

from angelspec_hf.tgi_patch.server import running_in_thread  # noqa: E402

pytestmark = [pytest.mark.real_model,  # text_generation 0.7.0 calls pydantic's deprecated .dict()
              pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")]
NEW = 12
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def live():
    target, tokenizer = real_target()
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"][0].tolist()
    refs = {"text": reference(tokenizer(PROMPT).input_ids, NEW), "chat": reference(chat_ids, NEW)}
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
    assert len(out.details.prefill) == len(real_target()[1](PROMPT).input_ids)
    stream = list(client.generate_stream(PROMPT, max_new_tokens=NEW))
    assert [r.token.id for r in stream] == refs["text"] and stream[-1].generated_text == texts["text"]
    assert stream[-1].details.generated_tokens == NEW
    with pytest.raises(text_generation.errors.ValidationError, match="max_new_tokens"):
        client.generate(PROMPT, max_new_tokens=10_000)
    with pytest.raises(text_generation.errors.ValidationError, match="repetition_penalty"):
        client.generate(PROMPT, max_new_tokens=2, repetition_penalty=1.3)


def test_huggingface_hub_inference_client(live):
    url, refs, texts = live
    client = InferenceClient(base_url=url, timeout=120)
    assert client.text_generation(PROMPT, max_new_tokens=NEW) == texts["text"]
    details = client.text_generation(PROMPT, max_new_tokens=NEW, details=True)
    assert [t.id for t in details.details.tokens] == refs["text"] and details.generated_text == texts["text"]
    assert "".join(client.text_generation(PROMPT, max_new_tokens=NEW, stream=True)) == texts["text"]
    streamed = list(client.text_generation(PROMPT, max_new_tokens=NEW, stream=True, details=True))
    assert [s.token.id for s in streamed] == refs["text"] and streamed[-1].details.generated_tokens == NEW

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
