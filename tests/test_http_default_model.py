"""The HTTP front on the default model, through the official `openai` client."""
import subprocess
import sys
import time

import httpx2
import openai

from tests.served import free_ports


def test_chat_on_the_default_model_reports_cached_tokens_the_second_time():
    port, zmq_port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "stemma", "serve", "--port", str(port),
                             "--zmq-port", str(zmq_port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx2.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        messages = [{"role": "system", "content": "You answer questions about geography."},
                    {"role": "user", "content": "What is the capital of France?"}]
        first = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                               temperature=0)
        assert first.choices[0].message.content.strip()
        assert first.usage.completion_tokens > 0
        second = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= second.usage.prompt_tokens - 1, second.usage
        print(f"{model}: {first.choices[0].message.content!r}; second request: {cached} of "
              f"{second.usage.prompt_tokens} prompt tokens cached")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
