"""Smoke test on the real SmolLM2-135M-Instruct: chat through the server, speculation on and off."""

from __future__ import annotations

import httpx
import openai


def test_smollm2_chat_with_and_without_speculation(launch):
    srv = launch("--target", "smollm2-135m", "--draft", "prune:0,1,2,29", "--k", "2", "--dtype", "fp32")
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
        kw = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "Name three primary colours."}],
            "max_tokens": 12,
            "temperature": 0,
        }
        spec = c.chat.completions.create(**kw)
        metrics = httpx.get(f"{srv.url}/metrics").text
        plain = c.chat.completions.create(**kw, extra_body={"speculation": "off"})
    finally:
        code = srv.terminate()
    assert code == 0
    assert spec.choices[0].message.content.strip()  # an instruct model answers in words
    assert spec.choices[0].message.content == plain.choices[0].message.content  # speculation is lossless
    assert spec.usage.completion_tokens == plain.usage.completion_tokens <= 12
    drafted = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("specdraft:spec_decode_num_draft_tokens_total")
    )
    assert drafted > 0
