"""Tokenization stage: text to token ids and back. `tokenizer.Tokenizer` (a HF tokenizer.json or a GGUF file's own
vocabulary: `gguf`, `gguf_spm`), `detokenizer` (incremental, for streaming), `chat_template` (Jinja chat templates).

Modules are imported by name: this package exports nothing itself."""
