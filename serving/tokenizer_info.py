"""vLLM's GET /tokenizer_info body for the served model: what lm-evaluation-harness's remote tokenizer reads (the
special tokens, the chat template) and the rest of a tokenizer configuration vLLM reports."""

from __future__ import annotations

from netra_jax.serving.context import ServingContext
from netra_jax.serving.protocol import TokenizerInfoResponse

# the transformers class a tokenizer.json (or a GGUF file's tokenizer) loads as; vLLM reports its tokenizer's class
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def tokenizer_info(ctx: ServingContext) -> TokenizerInfoResponse:
    """The served tokenizer's configuration; `chat_template`: the server's --chat-template, else the model's."""
    tok = ctx.llm.tokenizer
    special = tok.special
    added = tok.backend.get_added_tokens_decoder()
    return TokenizerInfoResponse(
        tokenizer_class=TOKENIZER_CLASS,
        bos_token=special.bos_token,
        eos_token=special.eos_token,
        pad_token=special.pad_token,
        unk_token=special.unk_token,
        model_max_length=ctx.llm.max_model_len,
        added_tokens_decoder={str(i): t.content for i, t in sorted(added.items())},
        chat_template=ctx.chat_template or tok.chat_template,
    )
