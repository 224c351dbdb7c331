"""The engine stage, vLLM v1's split: `input_processor` (prompts to requests), `scheduler` and `block_pool` (one
scheduling rule over the paged KV blocks), `runner` (the jitted step), `output_processor` (tokens to outputs).

Driven by `engine.LLMEngine` (one thread) and `async_engine.AsyncEngine` (the server's engine thread); built by
`factory.build_engine`; watched through `observer.EngineObserver` (the step trace is one); speculative decoding in
`spec`. Modules are imported by name: this package exports nothing itself."""
