"""Log-probabilities of sampled tokens for a trainer: `sequence_logprobs` recomputes, from the parameter pytree, the raw
and processed log-probability of every output token the engine sampled, bit for bit what a batch-invariant engine
(`LLM(..., batch_invariant=True)`) reported in `CompletionOutput.raw_logprobs` / `processed_logprobs`.

Why they agree exactly: both run `models.transformer.forward` on the "cpu_invariant" kernels, where every matmul sums
each output over its inputs in order (`ops.cpu_matmul.invariant_matmul`), every token's attention walks its keys in
order of position (`ops.attention.cpu.paged_attention_cpu_invariant`) and every other sum (norms, the experts'
weighted outputs, the softmax of the logprobs) is a fixed pairwise tree (`ops.invariant`): a row's result does not
depend on the rows beside it, on how a prompt was chunked, on prefix-cache hits or on preemption. The same host code
builds each token's sampling row (`engine.sampler.row_sampling`: temperature, filters, bias, penalties, min_tokens)
and the same device function computes the logprobs (`ops.sampling.sampled_logprobs`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.config import ModelConfig
from netra_jax.engine.sampler import row_sampling
from netra_jax.models.transformer import forward, init_kv_cache
from netra_jax.ops import sampling
from netra_jax.ops.attention.paged_batch import build_batch
from netra_jax.ops.kv_quant import storage_dtype
from netra_jax.sampling_params import SamplingParams

__all__ = ["SequenceLogprobs", "sequence_logprobs"]

_PAGE = 16  # page size of the scratch cache (the kernels' results do not depend on it)


class SequenceLogprobs(NamedTuple):
    """Each output token's log-probability given everything before it, float32 [num_output_tokens] (a pytree: jit
    and grad return it as it is).

    Attributes:
        raw: Under the raw distribution, the log_softmax of the model's logits (`CompletionOutput.raw_logprobs`,
            vLLM's default logprobs).
        processed: Under the processed distribution the engine drew the token from: logits after logit bias
            (and min_tokens' EOS ban) and penalties, divided by the temperature, renormalised over the min-p / top-k
            / top-p survivors (-inf for a token outside them); for greedy requests the logits after bias and penalties
            (`CompletionOutput.processed_logprobs`, vLLM's "processed_logprobs").
    """

    raw: jax.Array
    processed: jax.Array


def sequence_logprobs(
    params: Mapping,
    cfg: ModelConfig,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    output_ids: Sequence[int] | Sequence[Sequence[int]],
    sampling_params: SamplingParams | Sequence[SamplingParams],
    *,
    kv_cache_dtype: str = "auto",
    backend: str = "cpu_invariant",
    matmul_backend: str = "cpu_invariant",
) -> SequenceLogprobs | list[SequenceLogprobs]:
    """The raw and processed log-probability of each output token of one sequence (or of several, packed into one
    ragged forward), from `params`: what a batch-invariant engine reported for those tokens, bit for bit.

    Differentiable in params (`jax.grad`, `jax.value_and_grad`; attention's backward is the dense reference, the
    matmuls' is XLA's dot), and jittable with the token ids and sampling parameters fixed (they shape the program: a
    padded power-of-two token count, compiled once per size).

    Args:
        params: The parameter pytree (`LLM.params`, `netra_jax.loader.load_model`'s, or a trainer's copy of it).
        cfg: The model's config (`LLM.model_config`).
        prompt_ids: One prompt's token ids, or a list of them.
        output_ids: The tokens sampled after it (at least one), or one list per prompt.
        sampling_params: What the tokens were sampled with (one for all sequences, or one per sequence): its
            temperature, top_k, top_p, min_p, penalties, logit_bias and min_tokens shape the processed distribution.
        kv_cache_dtype: The engine's `kv_cache_dtype` ("auto": the weights' dtype): the keys and values are read back
            from a cache of this type.
        backend: The attention backend; the default is the batch-invariant engine's. Others give the same numbers
            up to rounding.
        matmul_backend: The matmul backend, likewise.

    Returns:
        A SequenceLogprobs of [len(output_ids)] float32 arrays; for a list of prompts, one per prompt.

    Raises:
        ValueError: Mismatched lengths, an empty prompt or output, ids outside the vocabulary, invalid sampling
            parameters, or structured outputs (a grammar's mask is the engine's state, not recomputed here).
    """
    single = _is_ids(prompt_ids)
    prompts = [list(prompt_ids)] if single else [list(p) for p in prompt_ids]
    outputs = [list(output_ids)] if single else [list(o) for o in output_ids]
    if len(prompts) != len(outputs) or not prompts:
        raise ValueError(f"{len(prompts)} prompts for {len(outputs)} outputs (one output per prompt, at least one)")
    plist = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(plist)} sampling params for {len(prompts)} sequences")
    for i, (p, o, sp) in enumerate(zip(prompts, outputs, plist, strict=True)):
        _check(i, p, o, sp, cfg.vocab_size)

    # the model runs on prompt + output but the last output token (its logprob is the row before it)
    seqs = [p + o[:-1] for p, o in zip(prompts, outputs, strict=True)]
    lens = [len(s) for s in seqs]
    T = _pow2(max(sum(lens), _PAGE))
    S = _pow2(len(seqs))
    tables, first = [], 0
    for n in lens:
        pages = -(-n // _PAGE)
        tables.append(range(first, first + pages))
        first += pages
    batch = build_batch(  # padded sizes only (tokens, sequences, block-table width): one program per bucket
        lens, lens, tables, page_size=_PAGE, num_pages=T // _PAGE + S, num_tokens=T, num_seqs=S, max_pages=T // _PAGE
    )
    tokens = np.zeros(T, np.int32)
    tokens[: sum(lens)] = [t for s in seqs for t in s]

    rows, targets, samplings, start = [], [], [], 0
    for p, o, sp, n in zip(prompts, outputs, plist, lens, strict=True):
        for j, token in enumerate(o):
            rows.append(start + len(p) - 1 + j)  # the row whose logits predict output token j
            targets.append(token)
            samplings.append(row_sampling(sp, p, o[:j], cfg.eos_token_ids))
        start += n
    N = _pow2(len(rows))
    sb = sampling.build_sampling_batch(samplings, N, cfg.vocab_size)
    raw, processed = _logprobs(
        params,
        jnp.asarray(tokens),
        batch.positions,
        batch.metadata,
        jnp.asarray(np.pad(rows, (0, N - len(rows))).astype(np.int32)),
        jnp.asarray(np.pad(targets, (0, N - len(rows))).astype(np.int32)),
        sb.arrays,
        cfg=cfg,
        key=sampling.logprob_key(sb.key),
        num_pages=T // _PAGE + S,
        kv_dtype=storage_dtype(kv_cache_dtype, params["embed"].dtype),
        backend=backend,
        matmul_backend=matmul_backend,
    )
    out, at = [], 0
    for o in outputs:
        out.append(SequenceLogprobs(raw[at : at + len(o)], processed[at : at + len(o)]))
        at += len(o)
    return out[0] if single else out


@functools.partial(jax.jit, static_argnames=("cfg", "key", "num_pages", "kv_dtype", "backend", "matmul_backend"))
def _logprobs(
    params, tokens, positions, md, rows, targets, arrays, *, cfg, key, num_pages, kv_dtype, backend, matmul_backend
):
    """(raw, processed) logprobs [N] of targets [N] at logit rows [N] of one padded ragged forward over tokens [T]."""
    kv = init_kv_cache(cfg, num_pages, _PAGE, kv_dtype)
    logits, _ = forward(
        params, cfg, tokens, positions, kv, md, rows, backend=backend, matmul_backend=matmul_backend
    )  # [N, vocab] float32
    return sampling.sampled_logprobs(logits, targets, arrays, key=key)


def _check(i: int, prompt: list[int], output: list[int], sp: SamplingParams, vocab_size: int) -> None:
    if not prompt or not output:
        raise ValueError(f"sequence {i}: the prompt and the output need at least one token each")
    bad = [t for t in (*prompt, *output) if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"sequence {i}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"sequence {i}: sampling_params must be a SamplingParams, got {type(sp).__name__}")
    sp.validate(vocab_size)
    if sp.structured_outputs is not None:
        raise ValueError(f"sequence {i}: structured outputs' masks are not recomputed; score such tokens unconstrained")


def _is_ids(x) -> bool:
    """One sequence of token ids rather than a list of them."""
    return (
        isinstance(x, np.ndarray)
        and x.ndim == 1
        or (isinstance(x, Sequence) and bool(x) and isinstance(x[0], (int, np.integer)))
    )


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
