"""The RL lifecycle verbs at the ingress of `pagedkv serve --replicas 2` (a local Ray cluster for this module):
each verb is broadcast to every replica and answered once all applied it. Tiny CPU replicas
(`pagedkv.serve.ray_app:tiny_engine`), driven over raw HTTP (httpx) as a trainer would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (the `ray` extra)")

from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.llm_engine import Engine  # noqa: E402
from pagedkv.engine.params import SamplingParams  # noqa: E402
from pagedkv.hf.tiny import tiny_model  # noqa: E402
from pagedkv.serve.ray_app import Deployed, ReplicaSet, running  # noqa: E402
from pagedkv.serve.replica_calls import ReplicaTarget  # noqa: E402

PROMPTS = [[1, 28, 29, 30, 31, 32, 33, 34, 35, 36, 40 + i, 50 + i] for i in range(3)]


def perturbed() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in tiny_model("llama", 0).state_dict().items()}


@pytest.fixture(scope="module")
def app() -> Iterator[Deployed]:
    spec = ReplicaSet(replicas=2, num_cpus=0.5, stats_period_s=0.5)
    try:
        with running(spec, num_cpus=2, app_name="pagedkv-lifecycle-test") as deployed:
            yield deployed
    finally:
        ray.shutdown()


def greedy(client: httpx.Client, prompt: list[int]) -> list[str]:
    body = {"model": "pagedkv", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["logprobs"]["tokens"])


def fresh(weights: dict[str, torch.Tensor] | None, prompt: list[int]) -> list[str]:
    engine = Engine(tiny_model("llama", 0), None, EngineConfig(num_blocks=96, block_size=4))
    if weights is not None:
        engine.update_weights(weights)
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    return [f"<{t}>" for t in out.output_token_ids]


def two_replicas(client: httpx.Client) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + 60
    while True:
        state = client.get("/lifecycle").json()
        if len(state.get("replicas", [])) == 2:
            return state
        assert time.monotonic() < deadline, f"the ingress does not see 2 replicas: {state}"
        time.sleep(0.5)


def test_update_weights_at_the_ingress_reaches_every_replica(app: Deployed, tmp_path_factory: Any) -> None:
    from safetensors.torch import save_file

    client = httpx.Client(base_url=app.url, timeout=120)
    state = two_replicas(client)
    assert {r["weight_version"] for r in state["replicas"]} == {"0"}
    assert greedy(client, PROMPTS[0]) == fresh(None, PROMPTS[0])
    new = perturbed()
    folder: Path = tmp_path_factory.mktemp("weights")
    save_file({k: v.contiguous() for k, v in new.items()}, str(folder / "model.safetensors"))
    up = client.post("/update_weights", json={"path": str(folder), "version": "7"})
    assert up.status_code == 200, up.text
    assert len(up.json()["replicas"]) == 2 and up.json()["weight_version"] == "7"
    assert all(r["weight_version"] == "7" and r["flushed"] is True for r in up.json()["replicas"])
    models = client.get("/v1/models")
    card = models.json()["data"][0]
    assert card["weight_version"] == "7" and card["weight_versions_differ"] is False
    assert sorted(card["weight_versions"].values()) == ["7", "7"]
    assert models.headers["x-pagedkv-weight-version"] == "7"
    for prompt in PROMPTS:  # the KV-aware router spreads new prompts; every replica serves the new weights
        assert greedy(client, prompt) == fresh(new, prompt) != fresh(None, prompt)
    bad = client.post("/update_weights", json={"path": str(folder / "none")})
    assert bad.status_code == 400 and "not a folder" in bad.json()["error"]["message"]
    assert bad.json()["applied"] == [] and len(bad.json()["replicas"]) == 2


def test_pause_resume_broadcast_and_versions_that_differ_are_reported(app: Deployed, tmp_path_factory: Any) -> None:
    client = httpx.Client(base_url=app.url, timeout=120)
    state = two_replicas(client)
    paused = client.post("/pause", params={"mode": "abort"})
    assert paused.status_code == 200 and [r["paused"] for r in paused.json()["replicas"]] == ["abort", "abort"]
    refused = client.post("/v1/completions", json={"model": "pagedkv", "prompt": PROMPTS[0], "max_tokens": 2})
    assert refused.status_code == 503
    again = client.post("/sleep", params={"level": 1})  # paused: nothing in flight, both sleep
    assert again.status_code == 200 and all(r["sleep_level"] == 1 for r in again.json()["replicas"])
    twice = client.post("/sleep", params={"level": 1})
    assert twice.status_code == 409 and twice.json()["applied"] == []
    assert client.post("/wake_up").status_code == 200
    resumed = client.post("/resume")
    assert resumed.status_code == 200 and all(r["paused"] is None for r in resumed.json()["replicas"])
    assert len(greedy(client, PROMPTS[1])) == 6
    one = state["replicas"][0]["replica"]
    version = state["replicas"][0]["weight_version"]
    folder = str(tmp_path_factory.getbasetemp() / "weights0")  # same weights, only renamed: no flush needed
    answer = app.replicas.lifecycle.remote(
        ReplicaTarget(one), "update_weights", {"path": folder, "version": "99", "flush_cache": False}
    ).result(timeout_s=60)
    assert answer["status"] == 200, answer
    card = client.get("/v1/models").json()["data"][0]
    assert card["weight_versions_differ"] is True and card["weight_version"] is None
    assert card["weight_versions"][one] == "99" and version != "99"
