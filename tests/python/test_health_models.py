"""Health endpoints and `GET /v1/models`."""

from __future__ import annotations

import openai

from conftest import SERVED_NAME


def test_health(router) -> None:
    r = router.get("/health")
    assert r.status == 200
    assert router.get("/health/ready").status == 200
    assert router.get("/no/such/route").status == 404


def test_models_lists_served_name(
    client: openai.OpenAI, max_model_len: int, model_dir
) -> None:
    models = list(client.models.list())
    ids = [m.id for m in models]
    assert ids[0] == SERVED_NAME, ids
    for m in models:
        assert m.object == "model"
        # As vLLM: `root` is the model folder.
        assert (m.model_extra or {}).get("root") == str(model_dir)
    assert max_model_len >= 1024
