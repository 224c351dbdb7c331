"""The whole engine with the Pallas ragged paged attention kernel selected (interpret mode on CPU): batched greedy
outputs on a tiny fixture equal the transformers references, as with the jnp reference backend."""

from __future__ import annotations

from support.checkpoints import FIXTURES, reference

from netra_jax import LLM, SamplingParams


def test_engine_greedy_with_kernel_backend():
    for name in ("tiny-llama", "tiny-gemma3"):  # GQA, and MQA with sliding-window layers
        llm = LLM(
            FIXTURES / name,
            dtype="float32",
            attention_backend="triton_interpret",
            max_num_seqs=4,
            max_num_batched_tokens=64,
            warmup=False,
        )
        assert llm.engine.runner.backend == "triton_interpret"
        cases = reference(name)["cases"]
        outs = llm.generate(
            [{"prompt_token_ids": c["prompt_ids"]} for c in cases],
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        for out, case in zip(outs, cases, strict=True):
            assert out.outputs[0].token_ids == case["greedy_ids"], name
