"""Models that cannot be loaded are reported by every CLI command in one line with exit status 2, and a base model
without a chat template serves completions while chat requests get a clear 400 (server) or one line (`chat`)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.checkpoints import DATA
from support.server import start_server
from support.spm_gguf import write_spm_gguf

import netra_jax.engine_args
from netra_jax.cli import main
from netra_jax.engine_args import CLIError
from netra_jax.engine_config import EngineConfig

REFERENCE = json.loads((DATA / "spm-gguf" / "reference.json").read_text("utf-8"))
PROTO = base64.b64decode(REFERENCE["vocabs"]["llama-bpe"]["proto"])
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMALL = ["--no-warmup", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--num-kv-pages", "16"]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF base model: SentencePiece vocabulary, random weights, no tokenizer.chat_template."""
    return write_spm_gguf(tmp_path_factory.mktemp("base") / "base.gguf", PROTO)


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory, base_model: Path) -> dict[str, tuple[Path, str]]:
    """Models that cannot be loaded: name -> (path, words the one-line reason must contain)."""
    root = tmp_path_factory.mktemp("broken")
    (root / "notes").mkdir()
    (root / "notes" / "README.md").write_text("not a model")
    (root / "bert").mkdir()
    (root / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "vocab_size": 8}))
    (root / "cut.gguf").write_bytes(base_model.read_bytes()[:3000])
    return {
        "missing": (root / "missing", "does not exist"),
        "not a model": (root / "notes", "config.json"),
        "unsupported architecture": (root / "bert", "unsupported architecture"),
        "unsupported tokenizer": (
            write_spm_gguf(root / "t5.gguf", PROTO, tokenizer_model="t5"),
            "GGUF tokenizer model 't5' is not supported",
        ),
        "corrupt file": (root / "cut.gguf", "truncated"),
    }


def _command(cmd: str, model: Path, tmp_path: Path) -> list[str]:
    if cmd == "batch":
        (tmp_path / "in.jsonl").write_text("")
        return ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", str(model), *SMALL]
    if cmd == "serve":
        return ["serve", str(model), "--port", "0", *SMALL]
    return [cmd, "Hello", str(model), *SMALL[1:]]


def _one_line(err: str, prefix: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(prefix), err
    return lines[0]


@pytest.mark.parametrize(
    "case", ["missing", "not a model", "unsupported architecture", "unsupported tokenizer", "corrupt file"]
)
@pytest.mark.parametrize("cmd", ["generate", "chat", "serve", "batch"])
def test_every_command_reports_a_model_it_cannot_load(cmd, case, broken, tmp_path, capsys) -> None:
    model, why = broken[case]
    assert main(_command(cmd, model, tmp_path)) == 2
    line = _one_line(capsys.readouterr().err, f"netra-jax {cmd}: cannot load the model {model}: ")
    assert why in line


def test_exit_status_and_single_line_from_the_process(broken, tmp_path) -> None:
    model, why = broken["unsupported tokenizer"]
    r = subprocess.run(
        [sys.executable, "-m", "netra_jax.cli", *_command("generate", model, tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 2 and why in _one_line(r.stderr, "netra-jax generate: cannot load the model")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "netra_jax.cli",
            "bench",
            "serve",
            "--launch",
            "--server-args",
            f"{broken['missing'][0]}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    line = _one_line(r.stderr, "netra-jax bench serve: the launched server did not start: netra-jax serve: cannot load")
    assert r.returncode == 2 and "does not exist" in line


def test_chat_without_a_template_is_one_line(base_model, tmp_path, capsys) -> None:
    assert main(["chat", "Hello", str(base_model), *SMALL[1:]]) == 2
    line = _one_line(capsys.readouterr().err, "netra-jax chat: the model has no chat template")
    assert "--chat-template" in line
    (tmp_path / "chatml.jinja").write_text(CHATML)
    args = ["chat", "Hello", str(base_model), "--max-tokens", "3", "--chat-template", str(tmp_path / "chatml.jinja")]
    assert main([*args, *SMALL[1:]]) == 0
    assert capsys.readouterr().out.strip()


def test_base_model_serves_completions_and_refuses_chat(base_model) -> None:
    server = start_server(*SMALL, model=str(base_model))
    try:
        assert "no chat template" in server.log.read_text()
        body = {"model": "base", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        messages = [{"role": "user", "content": "Hello"}]
        for route, body in [
            ("/v1/chat/completions", {"model": "base", "messages": messages, "max_tokens": 4}),
            ("/tokenize", {"model": "base", "messages": messages}),
        ]:
            r = httpx.post(server.url + route, json=body, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "no_chat_template"
            assert err["param"] == "messages"
            assert "no chat template" in err["message"] and "--chat-template" in err["message"]
    finally:
        server.stop()


def _failing(error: Exception):
    def fail(*args, **kwargs):
        raise error

    return fail


@pytest.mark.parametrize(
    "command, replaced", [("load_engine", "engine.factory.build_engine"), ("check_model", "loader.load_config")]
)
def test_load_errors_are_one_line_with_the_traceback_at_debug_level_and_bugs_keep_theirs(
    command: str, replaced: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A model that cannot be loaded is one line for the user and its traceback a debug record; any other exception
    is a bug of ours and propagates with its own traceback."""
    call, config = getattr(netra_jax.engine_args, command), EngineConfig(model=str(tmp_path))
    monkeypatch.setattr(f"netra_jax.{replaced}", _failing(ValueError("the file is damaged")))
    with caplog.at_level("DEBUG", logger="netra_jax.engine_args"), pytest.raises(CLIError, match="the file is damaged"):
        call(config)
    (record,) = [r for r in caplog.records if r.name == "netra_jax.engine_args"]
    assert record.levelname == "DEBUG" and record.exc_info[1].args == ("the file is damaged",)
    monkeypatch.setattr(f"netra_jax.{replaced}", _failing(KeyError("a bug of ours")))
    with pytest.raises(KeyError, match="a bug of ours"):
        call(config)
