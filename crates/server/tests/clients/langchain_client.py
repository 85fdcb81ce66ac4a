"""LangChain's OpenAI integration against a running ragscope server: `ChatOpenAI` invoke and
stream, `OpenAIEmbeddings`. Run by crates/server/tests/api/clients.rs; by hand:

    RAGSCOPE_BASE_URL=http://127.0.0.1:8080/v1 python tests/clients/langchain_client.py
"""

import math
import os

from langchain_openai import ChatOpenAI, OpenAIEmbeddings

BASE = os.environ["RAGSCOPE_BASE_URL"]
KEY = os.environ.get("RAGSCOPE_API_KEY", "none")
PLAIN = os.environ.get("RAGSCOPE_PLAIN_MODEL", "SmolLM2-135M-Instruct-plain")

llm = ChatOpenAI(model=PLAIN, base_url=BASE, api_key=KEY, temperature=0, max_tokens=12, max_retries=0)
answer = llm.invoke("Describe the sea in one sentence.")
assert answer.content, answer
assert answer.response_metadata["finish_reason"] in ("stop", "length"), answer.response_metadata
assert answer.usage_metadata["output_tokens"] > 0, answer.usage_metadata

streamed = "".join(chunk.content for chunk in llm.stream("Describe the sea in one sentence."))
assert streamed == answer.content, (streamed, answer.content)

# The RAG model answers too (an empty store: no passages, still an answer).
rag = ChatOpenAI(model="ragscope", base_url=BASE, api_key=KEY, temperature=0, max_tokens=8, max_retries=0)
assert rag.invoke("What is the capital of France?").content

# No tiktoken length check: it would fetch OpenAI's encodings; the server counts tokens itself.
emb = OpenAIEmbeddings(
    model="all-MiniLM-L6-v2", base_url=BASE, api_key=KEY, check_embedding_ctx_length=False, max_retries=0
)
docs = emb.embed_documents(["the sea", "the ocean", "a tax form"])
query = emb.embed_query("the sea")
assert len(docs) == 3 and all(len(v) == 384 for v in docs), [len(v) for v in docs]
cos = lambda a, b: sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
assert cos(query, docs[0]) > 0.999
assert cos(docs[0], docs[1]) > cos(docs[0], docs[2])

print("langchain client: all checks passed")
