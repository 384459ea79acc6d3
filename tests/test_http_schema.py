"""schemathesis against the HTTP app's own OpenAPI schema (FastAPI generates it): a bounded number
of generated requests per route, on a real `stemma serve`. None may get a 5xx, and every 4xx must
carry OpenAI's error object. The context is kept short so that generated lengths stay cheap."""
import httpx2
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.served import HttpServed
from tests.test_http_api import KEY, TINY, folder  # noqa: F401,F811  (folder: the fixture)

EXAMPLES = 12


@pytest.fixture(scope="module")
def api_schema(folder):  # noqa: F811
    served = HttpServed(folder, "--api-key", KEY, "--max-context", "96", *TINY)
    try:
        yield served, schemathesis.openapi.from_url(served.url + "/openapi.json")
    finally:
        assert served.stop() == 0


def check(case, seen: list) -> None:
    if isinstance(case.body, dict) and "model" in case.body and len(seen) % 3:
        case.body["model"] = "tiny"  # else nearly every generated body names an unknown model
    response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert response.status_code < 500, (f"{case.method} {case.formatted_path}: {response.status_code} "
                                        f"{response.text[:500]}")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
    seen.append((case.path, response.status_code))


def assert_still_serving(served) -> None:
    """A normal completion right after a route's generated requests."""
    response = httpx2.post(served.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_no_5xx_and_every_4xx_is_an_error_object(api_schema):
    # schemathesis's pytest plugin and this pytest disagree, so each operation gets its own
    # hypothesis run here
    served, api_schema = api_schema
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/generate"}
    for op in operations:
        seen: list = []
        run = settings(max_examples=EXAMPLES, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))(given(case=op.as_strategy())(
                           lambda case: check(case, seen)))
        run()
        assert_still_serving(served)
        assert seen, f"{op.method} {op.path}: no request made"  # (a route without inputs: one)
        if op.path == "/v1/completions":  # the check passes a valid body too
            check(op.Case(body={"model": "tiny", "prompt": "hello", "max_tokens": 3},
                          media_type="application/json"), seen)
            assert seen[-1][1] == 200, seen[-1]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 3, "regex": "a+"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 3, "regex": "a+"}),
])
def test_top_logprobs_of_a_constrained_request(api_schema, path, body):
    served, _ = api_schema
    response = httpx2.post(served.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                           json={"model": "tiny", "max_tokens": 3, "temperature": 0, **body})
    assert response.status_code == 200, response.text
