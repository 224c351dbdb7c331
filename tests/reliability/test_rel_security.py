"""Security guards: API key on every route but /health, CORS off by default, --allowed-model-root, pickled and
remote-code checkpoints refused, sandboxed chat templates (see also test_server_guards.py, test_tokenizer.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest
from support.checkpoints import FIXTURES
from support.server import MODEL

from netra_jax.cli import main as cli_main
from netra_jax.serving.cli import check_model_root

KEY = "k-123"


@pytest.fixture(scope="module")
def engine():
    from netra_jax.engine.async_engine import AsyncEngine
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import CacheConfig, EngineConfig

    ae = AsyncEngine(
        build_engine(EngineConfig(model=str(FIXTURES / MODEL), warmup=False, cache=CacheConfig(num_pages=8)))
    )
    yield ae
    ae.shutdown()


def _app(engine, **kw):
    from netra_jax.serving.app import create_app
    from netra_jax.serving.debug import install_debug_routes

    app = create_app(engine, MODEL, ready=lambda: True, **kw)
    install_debug_routes(app)
    return app


def _call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.request(method, path, **kw)

    return asyncio.run(go())


def test_api_key_guards_every_route_including_debug(engine):
    app = _app(engine, api_key=KEY)
    routes = [(m, r.path.replace("{model_id:path}", MODEL)) for r in app.routes for m in sorted(r.methods or {"GET"})]
    assert ("GET", "/debug/engine") in routes and len(routes) >= 12
    for method, path in routes:
        r = _call(app, method, path)
        assert r.status_code == (200 if path == "/health" else 401), (method, path, r.status_code)
    assert _call(app, "GET", "/debug/engine", headers={"Authorization": f"Bearer {KEY}"}).json()["invariant"] == "ok"


def test_cors_is_off_by_default(engine):
    app = _app(engine)
    pre = {"Origin": "http://any.example", "Access-Control-Request-Method": "POST"}
    r = _call(app, "OPTIONS", "/v1/completions", headers=pre)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = _call(app, "GET", "/v1/models", headers={"Origin": "http://any.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = _call(_app(engine, cors_origins=["*"]), "OPTIONS", "/v1/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_allowed_model_root(tmp_path, capsys):
    root = tmp_path / "models"
    shutil.copytree(FIXTURES / MODEL, root / MODEL)
    (root / "escape").symlink_to(FIXTURES / MODEL)
    check_model_root(str(root / MODEL), str(root))  # inside: fine
    check_model_root(None, str(root))  # the embedded default model
    check_model_root(str(FIXTURES / MODEL), None)  # no root configured
    for bad, why in [
        (root / ".." / "models" / MODEL, "'..'"),
        (FIXTURES / MODEL, "outside"),
        (root / "escape", "outside"),
        ("/etc", "outside"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_model_root(str(bad), str(root))
        assert cli_main(["serve", str(bad), "--allowed-model-root", str(root)]) == 2
        assert why in capsys.readouterr().err


def _checkpoint(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(FIXTURES / MODEL, d)
    return d


def test_pickle_and_remote_code_checkpoints_are_refused(tmp_path, capsys):
    pickled = _checkpoint(tmp_path, "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    remote = _checkpoint(tmp_path, "remote")
    cfg = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "modeling_x.M"}}))
    for d, why in [(pickled, "pickle"), (remote, "remote code")]:
        assert cli_main(["serve", str(d), "--num-kv-pages", "8"]) == 2
        err = capsys.readouterr().err
        assert "cannot load the model" in err and why in err, err


def test_unsafe_chat_template_is_refused_at_start(capsys):
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    assert cli_main(["serve", str(FIXTURES / MODEL), "--num-kv-pages", "8", "--chat-template", template]) == 2
    assert "the chat template does not render" in capsys.readouterr().err
