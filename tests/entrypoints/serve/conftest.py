"""One real `jpaged serve` (and one offline LLM on the same model and pool) for the whole session:
the server tests share them, since starting a server and compiling its steps costs seconds."""

from __future__ import annotations

import pytest

# The server stack and its clients come with the test extra (`pip install -e ".[test]"`); in an
# environment without them these tests skip with the reason instead of failing collection.
for _module in ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install -e \".[test]\"")

import openai

from jpaged import LLM
from tests.helpers.server import running_server
from tests.helpers.text_assets import ASSET


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def offline():
    return LLM(str(ASSET), num_blocks=256, block_size=16, max_num_seqs=32, attention_backend="xla", warmup=False)
