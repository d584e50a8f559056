"""Health endpoints and `GET /v1/models`."""

from __future__ import annotations

import openai

from conftest import SERVED_NAME


def test_health(router) -> None:
    r = router.get("/health")
    assert r.status == 200
    assert router.get("/health/ready").status == 200
    assert router.get("/no/such/route").status == 404


def test_models_lists_served_name(client: openai.OpenAI, max_model_len: int) -> None:
    models = list(client.models.list())
    ids = [m.id for m in models]
    assert ids[0] == SERVED_NAME, ids
    for m in models:
        assert m.object == "model"
        assert (m.model_extra or {}).get("root") == SERVED_NAME
    assert max_model_len >= 1024
