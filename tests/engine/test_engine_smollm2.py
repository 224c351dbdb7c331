"""SmolLM2-135M through the batching engine: 32 chat prompts of mixed lengths generated together give, request by
request, the transformers reference answers and exactly what each prompt gives alone."""

from __future__ import annotations

import pytest
from support.checkpoints import reference

from netra_jax import LLM, SamplingParams

QUESTIONS = [
    "Name a planet.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
    "Explain photosynthesis in one sentence.",
    "List three fruits.",
    "What is the boiling point of water?",
    "Translate 'good morning' to French.",
    "Give me a synonym for happy.",
    "What is the largest ocean on Earth?",
    "Describe a cat in five words.",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
    "Suggest a name for a dog.",
    "What is the capital of Japan?",
    "Why do leaves change color in autumn?",
    "Tell me a fun fact about octopuses.",
    "What is the square root of 81?",
    "Recommend a book for a long flight.",
    "What does a thermometer measure?",
    "Summarize the plot of Cinderella in two sentences.",
    "What is the opposite of cold?",
    "Name a musical instrument with strings.",
    "How do bees make honey?",
    "What is the chemical symbol for gold?",
    "Give one tip for better sleep.",
    "What is a prime number?",
    "Which animal is known as the king of the jungle?",
    "Write a short greeting for a birthday card.",
]


@pytest.mark.slow
def test_smollm2_32_mixed_prompts_batched_equal_solo_and_reference(smollm2_path):
    # float activations (the reference's arithmetic; the default rounds them to int8 as llama.cpp does)
    llm = LLM(
        smollm2_path,
        dtype="float32",
        max_num_seqs=32,
        max_num_batched_tokens=512,
        warmup=False,
        matmul_backend="cpu_rows",
    )
    ref = reference("smollm2")["cases"]
    convs = [c["messages"] for c in ref] + [[{"role": "user", "content": q}] for q in QUESTIONS]
    assert len(convs) == 32
    sp = SamplingParams(max_tokens=48, temperature=0)
    batched = llm.chat(convs, sp, use_tqdm=False)
    for out, case in zip(batched, ref, strict=False):
        assert out.outputs[0].token_ids == case["greedy_ids"]
        assert out.outputs[0].text == case["greedy_text"]
    lens = {len(o.prompt_token_ids) for o in batched}
    assert len(lens) >= 8  # mixed prompt lengths
    for conv, out in zip(convs, batched, strict=True):
        alone = llm.chat(conv, sp, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, conv
    pool = llm.engine.pool
    pool.check_invariant()
    assert pool.num_in_use == 0


@pytest.mark.slow
def test_smollm2_reference_chats_with_ngram_speculation(smollm2_path):
    """With n-gram speculation the reference chats still give transformers' greedy answers, token for token (the
    engine's exactness guarantee), while proposals are made and some accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(
        smollm2_path, dtype="float32", max_num_seqs=4, warmup=False, speculative_config=spec, matmul_backend="cpu_rows"
    )
    ref = reference("smollm2")["cases"]
    sp = SamplingParams(max_tokens=48, temperature=0)
    for out, case in zip(llm.chat([c["messages"] for c in ref], sp, use_tqdm=False), ref, strict=True):
        assert out.outputs[0].token_ids == case["greedy_ids"]
        assert out.outputs[0].text == case["greedy_text"]
    stats = llm.engine.spec_stats()
    assert stats["num_accepted_tokens"] > 0, stats
    llm.engine.pool.check_invariant()
