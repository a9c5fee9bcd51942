"""`overbrainer serve`: a local web page over the runs folder (Starlette on uvicorn).

Imported only by the ``serve`` command: nothing else pays for Starlette or uvicorn.

Pages and endpoints (every ``{name}`` is a run folder's name, checked against the names
under the runs folder: nothing outside it can be reached, ``../`` and encoded variants
included)::

    GET  /                          the runs: state, progress, loss, settings; tick several to
                                    overlay their loss and validation curves
    GET  /run/{name}                one run: its graph coloured by each step's state (Mermaid),
                                    live loss / eval loss / lr curves with the schedule's phases
                                    shaded, the samples, a chat box, checkpoints, log tail,
                                    stop/resume; kept up to date by the events below, no reload
    GET  /api/runs                  [{"name", "state", "step", "steps", "loss", "eval_loss", "settings"}]
    GET  /api/runs/{name}           {"status", "progress", "checkpoints": [{"step", "phase", "decayed"}],
                                     "baked", "log", "graph" (Mermaid), "samples" (by prompt)}
    GET  /api/runs/{name}/metrics   {"lines": [metrics.jsonl lines with a step]}
    GET  /api/runs/{name}/events    server-sent events: "metrics" {"from", "lines"} (from 0: the
                                    whole file again, after a resume cut it), "info" (the run's
                                    JSON above) when it changed; each stream ends after 5 minutes
                                    and the browser's EventSource opens the next
    POST /api/runs/{name}/stop      ask it to stop        } need the header X-Overbrainer-Token
    POST /api/runs/{name}/resume    resume it             } (this start's token) and no other
    POST /api/runs/{name}/chat      {"messages", "checkpoint": step or null (the baked model),
                                     "max_new_tokens"} -> {"answer"}      } Origin
    GET  /static/{file}             the vendored uPlot 1.6 (MIT; static/uPlot.LICENSE) and
                                    Mermaid 11.17.2 (MIT; static/mermaid.LICENSE)

Chat loads the model in this process (``chat.Model``, torch imported then), keeps the last
two loaded, and answers one question at a time.

The token is made at each start and written into the pages this server serves; a page of
another origin can neither read it nor pass the Origin check.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import secrets
import socket
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import OverbrainerError
from ..folder import RunFolder
from ..graph import explain
from ..runtime.run import Run, runs

__all__ = ["app", "serve", "PortTaken"]

STATIC = Path(__file__).parent / "static"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
STREAM_SECONDS = 300  # one events stream; EventSource reconnects by itself
ROLES = ("system", "user", "assistant")
MAX_NEW_TOKENS = 1024


class PortTaken(OverbrainerError):
    """The port asked for is in use."""


def app(root: Path, token: str) -> Starlette:
    root = root.absolute()

    def run_of(request: Request) -> Run | None:
        name = request.path_params["name"]
        if not NAME.match(name) or ".." in name:
            return None
        path = root / name
        # the name is one of the runs folder's own entries, nothing resolved elsewhere
        if path.parent != root or not path.is_dir() or path.resolve().parent != root.resolve():
            return None
        if not (RunFolder(path).plan_json.is_file() or RunFolder(path).run_json.is_file()):
            return None
        return Run(path)

    def allowed(request: Request) -> str | None:
        """Why an action is refused, or None."""
        if not secrets.compare_digest(request.headers.get("x-overbrainer-token", ""), token):
            return "missing or wrong token"
        origin = request.headers.get("origin")
        if origin and origin != f"{request.url.scheme}://{request.url.netloc}":
            return "cross-origin request"
        if request.headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
            return "cross-site request"
        return None

    def summary(run: Run) -> dict:
        progress = run.progress()
        try:
            plan = json.loads(run.folder.plan_json.read_text())
        except (OSError, ValueError):
            plan = {}
        train = plan.get("train") or {}
        settings = {k: train.get(k) for k in ("learning_rate", "steps", "micro_batch_size", "lora_r", "adapter")
                    if train.get(k) is not None}
        return {"name": run.name, **{k: progress[k] for k in ("state", "step", "steps", "loss", "eval_loss")},
                "settings": settings}

    async def list_runs(request: Request) -> JSONResponse:
        return JSONResponse([summary(r) for r in runs(root)])

    def info(run: Run) -> dict:
        from ..trainers import checkpoint as ckpt
        from ..trainers.samples import by_prompt, read_samples

        points = []
        for step, path in ckpt.complete(run.folder.checkpoints):
            try:
                meta = ckpt.read_meta(path)
            except ckpt.DamagedMeta:
                meta = {"phase": "damaged"}  # the next bake sets it aside
            points.append({"step": step, "phase": meta.get("phase"), "decayed": meta.get("decayed")})
        graph = explain.render(explain.recorded(run.folder), "mermaid", plan="plan.json")
        return {"status": run.status, "progress": run.progress(), "checkpoints": points,
                "baked": (run.folder.baked / "config.json").is_file(), "log": run.log(30), "graph": graph,
                "samples": by_prompt(read_samples(run.folder.samples))}

    async def one_run(request: Request) -> Response:
        run = run_of(request)
        if run is None:
            return JSONResponse({"error": "no such run"}, 404)
        return JSONResponse(await run_in_threadpool(info, run))

    async def events(request: Request) -> Response:
        run = run_of(request)
        if run is None:
            return JSONResponse({"error": "no such run"}, 404)

        def lines() -> list[dict]:
            return [r for r in run.records() if "step" in r]

        async def stream():
            sent, said, seen = 0, None, None
            began = time.monotonic()
            while time.monotonic() - began < STREAM_SECONDS:
                try:
                    st = run.folder.metrics.stat()
                    now = (st.st_size, st.st_mtime_ns)
                except OSError:
                    now = None
                if now != seen:  # metrics.jsonl changed: what is new, or all of it after a cut
                    seen, got = now, await run_in_threadpool(lines)
                    start = sent if len(got) >= sent else 0
                    if got[start:] or start < sent:
                        yield _event("metrics", {"from": start, "lines": got[start:]})
                    sent = len(got)
                text = json.dumps(await run_in_threadpool(info, run))
                if text != said:
                    said = text
                    yield f"event: info\ndata: {text}\n\n"
                await asyncio.sleep(1)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def metrics(request: Request) -> Response:
        run = run_of(request)
        if run is None:
            return JSONResponse({"error": "no such run"}, 404)
        return JSONResponse({"lines": [r for r in run.records() if "step" in r]})

    def acted_on(request: Request) -> Run | Response:
        """The run an action names, or the refusal: 403 without the token or cross-origin,
        404 for no such run."""
        why = allowed(request)
        if why:
            return JSONResponse({"error": why}, 403)
        run = run_of(request)
        return run if run is not None else JSONResponse({"error": "no such run"}, 404)

    async def action(request: Request) -> Response:
        run = acted_on(request)
        if isinstance(run, Response):
            return run
        what = request.url.path.rsplit("/", 1)[-1]
        try:
            if what == "stop":
                state = run.stop(wait=False) if run.state in ("starting", "running", "stopping") else run.state
            else:
                state = run.resume().state if run.state != "done" else "done"
        except OverbrainerError as e:
            return JSONResponse({"error": str(e)}, 409)
        return JSONResponse({"state": state})

    models: OrderedDict = OrderedDict()  # (run, step) -> chat.Model, the last two used
    one_at_a_time = threading.Lock()

    def answer(run: Run, step: int | None, messages: list[dict], max_new_tokens: int) -> dict:
        from ..chat import Model

        with one_at_a_time:
            key = (run.name, step)
            model = models.pop(key, None)
            if model is None:
                model = Model.checkpoint(run.folder.root, step) if step is not None else Model.baked(run.folder.root)
            models[key] = model
            while len(models) > 2:
                models.popitem(last=False)
            said = model.chat(messages, max_new_tokens=max_new_tokens)
        note = "" if model.decayed else f"step {step} is from before the decay: not annealed, not the final model"
        return {"answer": said, "note": note}

    async def chat(request: Request) -> Response:
        run = acted_on(request)
        if isinstance(run, Response):
            return run
        try:
            body = await request.json()
            messages = body["messages"]
            step = body.get("checkpoint")
            max_new_tokens = int(body.get("max_new_tokens", 128))
            ok = (isinstance(messages, list) and messages and messages[-1].get("role") == "user"
                  and all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                          for m in messages)
                  and (step is None or (isinstance(step, int) and not isinstance(step, bool)))
                  and 0 < max_new_tokens <= MAX_NEW_TOKENS)
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            return JSONResponse({"error": 'send {"messages": [{"role": "user", "content": "..."}], "checkpoint": '
                                          f'STEP or null, "max_new_tokens": 1 to {MAX_NEW_TOKENS}}}, the last message '
                                          "the user's"}, 400)
        try:
            return JSONResponse(await run_in_threadpool(answer, run, step, messages, max_new_tokens))
        except OverbrainerError as e:
            return JSONResponse({"error": str(e)}, 409)

    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse(_page("runs", "", token))

    async def run_page(request: Request) -> HTMLResponse:
        run = run_of(request)
        if run is None:
            return HTMLResponse("no such run", 404)
        return HTMLResponse(_page(run.name, run.name, token))

    return Starlette(routes=[
        Route("/", index),
        Route("/run/{name}", run_page),
        Route("/api/runs", list_runs),
        Route("/api/runs/{name}", one_run),
        Route("/api/runs/{name}/metrics", metrics),
        Route("/api/runs/{name}/events", events),
        Route("/api/runs/{name}/chat", chat, methods=["POST"]),
        Route("/api/runs/{name}/stop", action, methods=["POST"], name="stop"),
        Route("/api/runs/{name}/resume", action, methods=["POST"], name="resume"),
        Mount("/static", StaticFiles(directory=STATIC)),
    ])


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or PortTaken in one line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortTaken(f"cannot listen on {host}:{port} ({e.strerror}); pick another with --port") from None
    sock.listen(64)
    return sock


def serve(root: Path, host: str = "127.0.0.1", port: int = 8765) -> None:
    import uvicorn

    sock = bind(host, port)
    token = secrets.token_urlsafe(24)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {host}: anyone who can reach this machine sees the runs "
              "(actions still need the page's token)", file=sys.stderr)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {root} on http://{shown}:{sock.getsockname()[1]}/  (ctrl-c ends it)", flush=True)
    # open event streams are cut at once on ctrl-c (EventSource reconnects to the next start)
    config = uvicorn.Config(app(root, token), log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def _page(title: str, run: str, token: str) -> str:
    return (STATIC / "page.html").read_text().replace("{{title}}", html.escape(title)).replace(
        "{{config}}", html.escape(json.dumps({"run": run, "token": token})))
