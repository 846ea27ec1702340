"""A fake vLLM OpenAI server (health, models, metrics, tokenize, completions, embeddings, responses, LoRA loading)
for the proxy's tests.

python benchmarks/mock_backend.py PORT [MODEL]
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = sys.argv[2] if len(sys.argv) > 2 else "mock"


async def health(_: Request) -> Response:
    return Response(status_code=200)


LORAS: list[str] = []  # adapters loaded with /v1/load_lora_adapter, listed as models (as vLLM does)


async def models(_: Request) -> Response:
    data = [{"id": MODEL, "object": "model", "max_model_len": 4096, "root": MODEL, "parent": None}]
    data += [{"id": name, "object": "model", "root": f"/loras/{name}", "parent": MODEL} for name in LORAS]
    return JSONResponse({"object": "list", "data": data})


async def load_lora(request: Request) -> Response:
    body = await request.json()
    LORAS.append(str(body["lora_name"]))
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


async def embeddings(request: Request) -> Response:
    body = await request.json()
    if body.get("model") not in (MODEL, *LORAS):
        return JSONResponse({"error": {"message": f"model {body.get('model')!r} not here"}}, status_code=404)
    vec = [float(len(str(body.get("input"))) % 7), 0.5]
    return JSONResponse({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": vec}],
                         "model": body["model"], "served_by": MODEL})  # fmt: skip


async def detokenize(request: Request) -> Response:
    body = await request.json()
    return JSONResponse({"prompt": " ".join(f"t{t}" for t in body.get("tokens", []))})


async def responses(request: Request) -> Response:
    body = await request.json()
    if body.get("stream"):

        async def gen():  # type: ignore[no-untyped-def]
            yield b'event: response.output_text.delta\ndata: {"delta": "hi"}\n\n'
            yield b'event: response.completed\ndata: {"served_by": "' + MODEL.encode() + b'"}\n\n'

        return StreamingResponse(gen(), media_type="text/event-stream")
    return JSONResponse({"object": "response", "output_text": "hi", "served_by": MODEL})


async def metrics(_: Request) -> Response:
    return PlainTextResponse(
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
    )


def _aimed_here(body: dict) -> bool:  # type: ignore[type-arg]
    """Tests: a fault a body asks for applies to the backend on port ``mock_http_error_port``, or to all without it."""
    return body.get("mock_http_error_port") in (None, int(sys.argv[1]))


def _asked_error(body: dict) -> Response | None:  # type: ignore[type-arg]
    """Tests: answer with the HTTP error ``mock_http_error``, as vLLM does for a body it cannot handle."""
    status = body.get("mock_http_error")
    if not status or not _aimed_here(body):
        return None
    error = {
        "error": {"message": "mock backend: failing as asked", "type": "InternalServerError", "code": status}
    }
    return JSONResponse(error, status_code=int(status))


async def tokenize(request: Request) -> Response:
    body = await request.json()
    if (error := _asked_error(body)) is not None:
        return error
    text = body.get("prompt") or json.dumps(body.get("messages"))
    # tests: a prompt naming "mock-tokenize-fail" (or "mock-tokenize-fail:PORT", this backend only) fails to
    # tokenize with a 500, as vLLM's /tokenize does when it cannot fetch a chat's image
    if re.search(rf"mock-tokenize-fail(?!:)|mock-tokenize-fail:{sys.argv[1]}\b", str(text)):
        return JSONResponse({"error": {"message": "mock: cannot fetch the image"}}, status_code=500)
    return JSONResponse({"tokens": list(range(len(str(text)) // 4 + 1))})


async def completions(request: Request) -> Response:
    body = await request.json()
    n = int(body.get("max_tokens") or 16)
    if (error := _asked_error(body)) is not None:
        return error
    fail_after = body.get("mock_fail_after")  # tests: die mid-stream after this many chunks (connection cut)
    if body.get("stream") and (body.get("kv_transfer_params") or {}).get("do_remote_prefill"):
        await asyncio.sleep(float(body.get("mock_decode_delay_s") or 0))
    if body.get("stream"):

        async def gen():  # type: ignore[no-untyped-def]
            for i in range(n):
                if body.get("mock_chunk_delay_s"):
                    await asyncio.sleep(float(body["mock_chunk_delay_s"]))
                if fail_after is not None and i == int(fail_after):
                    raise RuntimeError("mock backend: failing mid-stream as asked")
                chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")
    text = "".join(f" t{i}" for i in range(n))
    answer = {
        "id": "x",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
    }
    # tests: a long non-streamed generation
    await asyncio.sleep(float(body.get("mock_complete_delay_s") or 0))
    if body.get("mock_cut_body") and _aimed_here(body):
        # tests: the instance dies while writing its answer (half the declared body, then the connection drops)
        whole = json.dumps(answer).encode()

        async def half():  # type: ignore[no-untyped-def]
            yield whole[: len(whole) // 2]
            raise RuntimeError("mock backend: cutting the answer as asked")

        return StreamingResponse(
            half(), media_type="application/json", headers={"content-length": str(len(whole))}
        )
    params = body.get("kv_transfer_params") or {}
    if params.get("do_remote_prefill"):  # a decode leg (tests: a decode queued past the transfer deadline)
        await asyncio.sleep(float(body.get("mock_decode_delay_s") or 0))
    if params.get("do_remote_decode"):
        # A prefill leg: answer like DisaggConnector (sequential flow), after an optional delay (tests: deadlines).
        await asyncio.sleep(float(body.get("mock_prefill_delay_s") or 0))
        answer["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "transfer_id": params.get("transfer_id"),
            "remote_host": "127.0.0.1",
            "remote_port": 9,
        }
    return JSONResponse(answer)


app = Starlette(
    routes=[
        Route("/health", health),
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
    ]
)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
