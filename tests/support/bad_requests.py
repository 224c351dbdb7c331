"""The table of malformed and out-of-range requests every server must answer with a 4xx OpenAI error envelope naming
the field (`param`): run by the server tests one by one and by the reliability suite under load."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------- bad input
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


C, CC = "/v1/completions", "/v1/chat/completions"


BAD = [  # (method, path, json body or raw bytes, status, param)
    ("POST", C, {"prompt": "hi", "max_token": 5}, 400, "max_token"),
    ("POST", C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("POST", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", C, {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("POST", C, {"prompt": ""}, 400, "prompt"),
    ("POST", C, {"prompt": []}, 400, "prompt"),
    ("POST", C, {"prompt": [100000]}, 400, "prompt"),
    ("POST", C, {"prompt": [5, -1]}, 400, "prompt"),
    ("POST", C, {"prompt": [7] * 600}, 400, "prompt"),
    ("POST", C, {"prompt": [[1, 2], "x"]}, 400, "prompt"),
    ("POST", C, {}, 400, "prompt"),
    ("POST", C, b"{not json", 400, None),
    ("POST", C, b"[1, 2]", 400, None),
    ("POST", C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("POST", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("POST", C, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("POST", C, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("POST", C, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("POST", C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("POST", C, {"prompt": "hi", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("POST", C, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("POST", C, {"prompt": "hi", "stop_token_ids": [999999]}, 400, "stop_token_ids"),
    ("POST", C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("POST", C, {"prompt": "hi", "n": 0}, 400, "n"),
    ("POST", C, {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ("POST", C, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("POST", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("POST", C, {"prompt": "hi", "echo": True, "logprobs": -1}, 400, "logprobs"),
    ("POST", C, {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("POST", C, {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("POST", C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("POST", C, {"prompt": "hi", "stream": True, "stream_options": {"usage": True}}, 400, "stream_options.usage"),
    ("POST", C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("POST", C, {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    ("POST", CC, {"messages": []}, 400, "messages"),
    ("POST", CC, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("POST", CC, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("POST", CC, {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("POST", CC, {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("POST", CC, {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    (
        "POST",
        CC,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content",
    ),
    ("POST", CC, {**CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("POST", CC, {**CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("POST", CC, {**CHAT, "stream": "yes"}, 400, "stream"),
    ("POST", CC, {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("POST", CC, {**CHAT, "seed": -(2**63) - 1}, 400, "seed"),
    ("POST", CC, {**CHAT, "model": "other"}, 404, "model"),
    ("POST", "/tokenize", {}, 400, "prompt"),
    ("POST", "/detokenize", {"tokens": [99999]}, 400, "tokens"),
    ("GET", "/v1/nothing", None, 404, None),
    ("GET", C, None, 405, None),
    ("DELETE", "/v1/models", None, 405, None),
]
