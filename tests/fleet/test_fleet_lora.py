"""LoRA adapters on a real Ray fleet: two replicas that load the same --lora-modules, one device
slot each. /v1/models lists the adapters under the base; a request naming an adapter gets
transformers + peft's tokens; once a replica holds the adapter in its slot, the next request
naming it (no cached prefix) is routed there for that reason."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.store import convert
from tests.console.server_util import start_server
from tests.fleet.fleet_util import logged_in_console, state
from tests.fleet.test_fleet_ray import wait_for
from tests.runtime.test_families_config import PROMPT, build_hf

pytest.importorskip("ray.serve")
pytest.importorskip("peft")
pytestmark = pytest.mark.fleet

from tests.runtime.test_lora import N, build_adapter, peft_greedy  # noqa: E402


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet_lora")
    src = build_hf(tmp / "hf", "llama")
    convert(HFSource(src), tmp / "ck", progress=False)
    a0, a1 = build_adapter(src, tmp / "a0", 1), build_adapter(src, tmp / "a1", 2, r=4)
    with start_server(tmp / "ck", "--replicas", "2", "--min-replicas", "2", "--max-replicas", "2",
                      "--threads-per-replica", "1", "--kv-cache-memory", "1MiB", "--max-num-seqs", "4",
                      "--max-model-len", "256", "--lora-modules", f"tenant-a={a0}", f"tenant-b={a1}",
                      "--max-loras", "1", subcommand=("fleet", "serve"), env={"RAY_ADDRESS": ""},
                      ready_timeout=420) as srv:
        yield srv, src, a0, a1


def complete(srv, model: str, prompt: list[int], rid: str) -> dict:
    with srv.client(timeout=120) as c:
        r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0,
                                            "ignore_eos": True}, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    return r.json()


def test_fleet_lists_serves_and_routes_adapters(fleet):
    srv, src, a0, a1 = fleet
    with logged_in_console(srv) as console:
        wait_for(lambda: len(state(console)["replicas"]) == 2, 60, "two replicas")
        with srv.client() as c:
            models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["tenant-a"]["parent"] == srv.model and models["tenant-b"]["root"] == str(a1)
        with srv.client() as c:
            r = c.post("/v1/completions", json={"model": "tenant-zz", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        with srv.client() as c:
            want = c.post("/detokenize", json={"tokens": peft_greedy(src, a0, PROMPT)}).json()["prompt"].rstrip("\ufffd")
        assert complete(srv, "tenant-a", PROMPT, "lora-1")["choices"][0]["text"] == want

        def holder() -> str | None:
            for r in state(console)["replicas"]:
                if any(a[0] == "tenant-a" and a[2] for a in r.get("loras", ())):
                    return r["replica"]
            return None

        first = wait_for(holder, 30, "a replica reporting tenant-a in its slot")
        other = [int(t) for t in np.random.default_rng(5).integers(3, 200, 40)]  # no cached prefix anywhere
        complete(srv, "tenant-a", other, "lora-2")
        d = next(d for d in state(console)["decisions"] if d["request_id"].startswith("lora-2"))
        assert d["replica"] == first and d["reason"] == "lora", d
