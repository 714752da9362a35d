"""The endpoint's HTTP layer alone (`EndpointServer` over a backend that answers at once): a bad
request gets OpenAI's JSON error body with a 4xx status, a failing backend a 500, and the server
goes on serving."""

import pytest

pytest.importorskip("openai", reason="the openai client is not installed (pip install openai)")
import httpx  # noqa: E402  (the openai client's own HTTP library)

from tandem.agent.openai_request import EPISODE_HEADER, Choice  # noqa: E402
from tandem.agent.openai_server import EndpointServer  # noqa: E402


async def backend(request):
    if request.prompt == "boom":
        raise RuntimeError("a bug in the backend")
    return [Choice("7", [5], [-0.5], ["7"], "stop")], 3


def test_bad_requests_get_a_json_error_and_the_server_stays_up():
    refused = []
    server = EndpointServer(backend, "m", lambda episode, error: refused.append(episode))
    try:
        with httpx.Client(base_url=server.base_url, headers={EPISODE_HEADER: "e1"}) as http:
            cases = [
                (http.post("/completions", content=b"{not json"), 400, "the body is not JSON"),
                (http.post("/completions", json={"prompt": "a", "echo": True}), 400, "echo=True is not"),
                (
                    http.post("/completions", json={"prompt": "a"}, headers={EPISODE_HEADER: ""}),
                    400,
                    "missing",
                ),
                (http.post("/no/such/route", json={}), 404, "Not Found"),
                (http.get("/chat/completions"), 405, "Method Not Allowed"),
                (
                    http.post("/completions", json={"prompt": "boom"}),
                    500,
                    "RuntimeError: a bug in the backend",
                ),
            ]
            for response, status, message in cases:
                error = response.json()["error"]
                assert response.status_code == status and message in error["message"], error
                assert set(error) == {"message", "type", "param", "code"}
            assert cases[1][0].json()["error"]["param"] == "echo"
            ok = http.post("/completions", json={"prompt": "a"})
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == [5]
            assert http.get("/models").json()["data"][0]["id"] == "m"
        assert refused == ["e1", "e1", ""]  # the refusals the agent counts, by episode
    finally:
        server.close()
