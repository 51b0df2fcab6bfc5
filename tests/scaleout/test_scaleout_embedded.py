"""Scale-out with the embedded model (SmolLM2-135M): 2 replicas behind the Ray Serve ingress answer
exactly as the single-process server does (greedy), and a shared system prompt stays on one replica."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("ray.serve")

from radixserve import EngineConfig  # noqa: E402
from radixserve.scaleout.config import ClusterConfig  # noqa: E402
from radixserve.scaleout.local import ServeCluster  # noqa: E402
from radixserve.server import BackgroundServer, ServerConfig  # noqa: E402
from radixserve.server.replica_header import HEADER  # noqa: E402

pytest_plugins = ["server_testkit"]
from server_testkit import leaves_no_process  # noqa: E402

pytestmark = pytest.mark.slow
SYSTEM = "You are a friendly librarian. You recommend one book per answer and say why in a sentence."


@pytest.fixture(scope="module")
def embedded_cluster() -> Iterator[ServeCluster]:
    server = ServerConfig(port=0, web_dir=None, shutdown_grace_s=1.0)
    spec = ClusterConfig(replicas=2, torch_threads=1, stats_period_s=0.25)
    with leaves_no_process() as started, ServeCluster(EngineConfig(num_blocks=256), server, spec, num_cpus=2,
                                                      startup_timeout_s=600) as c:
        assert started(), "the cluster started no process of its own"
        yield c


def ask(url: str, question: str) -> httpx.Response:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r


def test_embedded_model_answers_equal_the_single_process_server(embedded_cluster: ServeCluster,
                                                                chat_server: BackgroundServer) -> None:
    questions = ["Something about the sea?", "A book for a rainy day?", "What should a child read first?"]
    cluster = [ask(embedded_cluster.url, q) for q in questions]
    single = [ask(chat_server.url, q) for q in questions]
    assert [r.json()["choices"][0]["message"]["content"] for r in cluster] == \
           [r.json()["choices"][0]["message"]["content"] for r in single]
    assert len({r.headers[HEADER] for r in cluster}) == 1  # one system prompt: one replica
    assert all(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 20 for r in cluster[1:])
