"""Serving on Ray Serve (the optional extra `aotbuild[ray]`): an `Ingress` replica takes HTTP and
routes each request to an `ImageServer` replica, which loads the artifact once, in its
constructor, and makes images (videos).

    POST /                        {"prompt": "...", "steps": 4, "seed": 0, "lora": "ink", ...}
                                  -> image/png (video/mp4), or JSON with base64 ones
    POST /v1/images/generations   OpenAI's images request ({"prompt", "n", "size": "WxH"}) -> b64_json
    POST /v1/images/edits         OpenAI's edits request (an image, and a mask) -> b64_json
    GET  /health                  200 once a replica's compiled models are loaded (what it serves,
                                  its process and counts only when started with health_details)

A bad request (unknown field, wrong type, a size no compiled variant covers, more steps than
allowed, a LoRA the server was not started with) gets a 4xx with a readable message, and the
replica goes on serving. Requests naming a LoRA go to a replica that holds it (Serve's model
multiplexing); requests of one call shape arriving together run as one batch, each with its own
seed. `aotbuild serve` runs it; `app()` gives the Serve application to run yourself.

A module per concern: `schema` (routes, the request's fields and limits, its checks), `openai_api`
(OpenAI's requests as this server's), `slots` (the LoRAs and checkpoints a replica may load, and
holds), `replica` (`ImageServer`), `ingress` (HTTP), `application` (the Serve application and
`aotbuild serve`), `client` (a small HTTP client). Nothing here imports the benchmarks.
"""

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from .application import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
