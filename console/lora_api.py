"""vLLM's runtime adapter routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Who may call them: on an open server (no API keys), anyone who may call /v1, as vLLM; once API
keys are on, an API key is not enough: the caller sends an operator's token (the --admin-token,
or a named operator's with the operator role) as its bearer, since an adapter changes what
every client of that name is served. Each load and unload is in the audit log with who did it.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, Router, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from console import schemas as S
from console.errors import EXCEPTION_HANDLERS, APIError

LORA_WHO = "pagedjax.lora_who"  # scope key: the operator the guard let through


def require_operator_when_keyed(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    from console.auth import _operator_for

    st = connection.app.state
    keyed = st.settings.api_key is not None or st.store.has_keys()
    who = "anonymous"
    if keyed:
        scheme, _sep, given = connection.headers.get("authorization", "").partition(" ")
        name, role = _operator_for(connection, given.strip()) if scheme.lower() == "bearer" else (None, "")  # type: ignore[arg-type]
        if name is None or role != "operator":
            raise APIError(403, "loading and unloading adapters needs an operator's token as the bearer when API "
                                "keys are on (an API key is not enough)", code="operator_required")
        who = name
    connection.scope[LORA_WHO] = who  # type: ignore[literal-required]


def require_lora_engine(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """After readiness: the engine can load adapters."""
    st = connection.app.state
    if not hasattr(st.engine, "load_lora"):  # a fleet's gateway
        raise APIError(400, "lora: a fleet serves the adapters its replicas load at start (--lora-modules); "
                            "it loads none at run time yet", code="lora_unsupported")


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


@post("/load_lora_adapter", status_code=200, summary="Load a PEFT LoRA adapter, served under its name")
async def load_lora_adapter(request: Request) -> Response:
    from runtime.core.lora import AdapterError

    body = S.decode_body(await request.body(), S.LoadLoraAdapterRequest)
    st = request.app.state
    if body.lora_name == st.settings.model_name:
        raise APIError(400, f"lora_name: {body.lora_name!r} is the base model's name", param="lora_name")
    try:
        await st.engine.load_lora(body.lora_name, body.lora_path)
    except AdapterError as exc:
        raise APIError.from_value_error(exc, default_param="lora_path") from None
    st.store.record(request.scope[LORA_WHO], "load_lora", name=body.lora_name, path=body.lora_path,  # type: ignore
                    client=_client(request))
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


@post("/unload_lora_adapter", status_code=200, summary="Unload a LoRA adapter (refused while requests use it)")
async def unload_lora_adapter(request: Request) -> Response:
    from runtime.core.lora import AdapterBusy

    body = S.decode_body(await request.body(), S.UnloadLoraAdapterRequest)
    st = request.app.state
    have = {a["name"]: a for a in st.engine.lora_adapters()}
    if body.lora_name not in have:
        raise APIError(404, f"lora_name: no adapter named {body.lora_name!r} is loaded", param="lora_name",
                       code="lora_not_found")
    if body.lora_int_id is not None and body.lora_int_id != have[body.lora_name]["lora_id"]:
        raise APIError(400, f"lora_int_id: {body.lora_name!r} is loaded with id {have[body.lora_name]['lora_id']}",
                       param="lora_int_id")
    try:
        await st.engine.unload_lora(body.lora_name)
    except AdapterBusy as exc:
        raise APIError(409, str(exc), param="lora_name", code="lora_in_use") from None
    except LookupError as exc:
        raise APIError(404, str(exc), param="lora_name", code="lora_not_found") from None
    st.store.record(request.scope[LORA_WHO], "unload_lora", name=body.lora_name, client=_client(request))  # type: ignore
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


def lora_router(require_ready: Any) -> Router:
    """`require_ready`: the app's readiness guard (console/app.py), run after the operator check."""
    return Router(path="/v1", route_handlers=[load_lora_adapter, unload_lora_adapter],
                  guards=[require_operator_when_keyed, require_ready, require_lora_engine],
                  exception_handlers=EXCEPTION_HANDLERS, tags=["LoRA"])
