"""The `openai` Python client against a running ragscope server: chat (plain and streamed),
`n`, `stop`, `logprobs`, legacy completions with echoed logprobs, embeddings, and errors that
name the field. Run by crates/server/tests/api/clients.rs; by hand:

    RAGSCOPE_BASE_URL=http://127.0.0.1:8080/v1 python tests/clients/openai_client.py

Every check is an assert; the exit status says whether all passed.
"""

import math
import os

import openai

BASE = os.environ["RAGSCOPE_BASE_URL"]
client = openai.OpenAI(base_url=BASE, api_key=os.environ.get("RAGSCOPE_API_KEY", "none"), max_retries=0)

models = [m.id for m in client.models.list()]
GENERATOR = next(m for m in models if m.endswith("-Instruct"))
PLAIN = GENERATOR + "-plain"
EMBEDDER = "all-MiniLM-L6-v2"
assert PLAIN in models and EMBEDDER in models, models

MESSAGES = [{"role": "user", "content": "Describe the sea in one sentence."}]


def chat(**kw):
    args = {"model": PLAIN, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    args.update(kw)
    return client.chat.completions.create(**args)


# Chat, then the same request streamed: the same greedy text, usage in the last chunk.
r = chat()
text = r.choices[0].message.content
assert text, r
assert r.choices[0].finish_reason in ("stop", "length"), r
assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0, r.usage
pieces, usage, finishes = [], None, []
for chunk in chat(stream=True, stream_options={"include_usage": True}):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finishes.append(c.finish_reason)
assert "".join(pieces) == text, (pieces, text)
assert finishes == [r.choices[0].finish_reason], finishes
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

# n: independent choices, each seeded (choice i is what n = 1 gives with seed + i).
r3 = chat(n=3, temperature=1.0, seed=5, max_tokens=8)
assert [c.index for c in r3.choices] == [0, 1, 2], r3
alone = chat(temperature=1.0, seed=7, max_tokens=8)
assert r3.choices[2].message.content == alone.choices[0].message.content

# stop: the text ends before the first stop string; finish_reason "stop".
words = text.split(" ")
assert len(words) > 3, text
stop = " " + words[len(words) // 2]
cut = chat(stop=["never-said", stop])
assert cut.choices[0].message.content == text[: text.index(stop)], (cut, stop)
assert cut.choices[0].finish_reason == "stop", cut

# logprobs: one entry per generated token; greedy picks the likeliest.
lp = chat(logprobs=True, top_logprobs=2).choices[0].logprobs.content
assert len(lp) == r.usage.completion_tokens, lp
for entry in lp:
    assert entry.logprob <= 0 and len(entry.top_logprobs) == 2, entry
    assert entry.top_logprobs[0].token == entry.token, entry

# Legacy completions: lm-eval's loglikelihood shape (echo + logprobs + max_tokens 1).
c = client.completions.create(
    model=PLAIN, prompt="The capital of France is Paris", max_tokens=1, echo=True, logprobs=1, temperature=0
)
choice = c.choices[0]
assert choice.text.startswith("The capital of France is Paris"), choice
tokens = choice.logprobs.token_logprobs
assert tokens[0] is None and all(t <= 0 for t in tokens[1:]), tokens
assert len(tokens) == c.usage.prompt_tokens + c.usage.completion_tokens, c.usage
gen = client.completions.create(model=PLAIN, prompt="Once upon a time", max_tokens=6, n=2, seed=1, temperature=1.0)
assert [x.index for x in gen.choices] == [0, 1], gen

# Embeddings (the client asks for base64 by default and decodes it).
e = client.embeddings.create(model=EMBEDDER, input=["the sea", "the ocean"])
assert len(e.data) == 2 and all(len(d.embedding) == 384 for d in e.data), e
norm = math.sqrt(sum(x * x for x in e.data[0].embedding))
assert abs(norm - 1) < 1e-3, norm
floats = client.embeddings.create(model=EMBEDDER, input="the sea", encoding_format="float")
assert max(abs(a - b) for a, b in zip(floats.data[0].embedding, e.data[0].embedding)) < 1e-6

# Errors: a 400 the client raises as BadRequestError, naming the field.
def refused(param, **kw):
    try:
        chat(**kw)
    except openai.BadRequestError as err:
        assert err.param == param, (err.param, param, err.body)
        assert err.message.startswith(param) or param in err.message, err.message
        return
    raise AssertionError(f"{kw} was not refused")


refused("tools", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
refused("temperature", temperature=5)
refused("messages[0].tool_calls", messages=[
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    MESSAGES[0],
])
refused("messages[0].content[0].type", messages=[
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
])
try:
    client.completions.create(model=PLAIN, prompt="Hi", max_tokens=2, logit_bias={"1": 3})
    raise AssertionError("logit_bias was not refused")
except openai.BadRequestError as err:
    assert err.param == "logit_bias", err.body
try:
    chat(model="gpt-4o")
    raise AssertionError("an unknown model was served")
except openai.NotFoundError as err:
    assert err.param == "model", err.body

print("openai client: all checks passed")
