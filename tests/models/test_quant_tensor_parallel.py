"""Quantized weights under tensor parallelism: how a split maps onto quantized arrays and the refusal of a K split
that cuts GGML blocks (in this process); each device's slice of a GGUF file's blocks de-quantizes to that slice of
the float parameter; on 2 fake CPU devices (a subprocess), online int8 / int4 / fp8 (dense and MoE) and GGUF Q8_0 /
Q4_0 files give tp=1's logits and greedy tokens at tp=2, quantized shard by shard without gathering any weight, and
a MoE whose experts' K does not split into whole Q4_0 / Q8_0 blocks is refused naming the weight."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.checkpoints import DATA, FIXTURES, reference
from support.hf_to_gguf import requantized, to_gguf
from support.workers import run_device_worker

from netra_jax import parallel
from netra_jax.config import ModelConfig
from netra_jax.loader import gguf_names, load_config
from netra_jax.loader.gguf_loader import GGUFFile
from netra_jax.models import weight_map, weight_reads
from netra_jax.ops.ggml_blocks import FORMATS, row_bytes
from netra_jax.quant import quantize_weight, shard_specs
from netra_jax.quant.online import quantize_q4_0

GGUF_DIR = DATA / "llamacpp-gguf"
TP = 2
GREEDY_TOKENS = 8
LOGPROBS = 20  # the top logprobs of every greedy step: the logits, to float rounding, up to their logsumexp
PROMPT = reference("tiny-qwen3")["cases"][0]["prompt_ids"]


def wide_moe(out: Path) -> Path:
    """tiny-qwen3-moe's config with a moe_intermediate_size of 64 (so each of 2 devices holds whole 32-value blocks
    of the experts' down projections), random weights (seeded), and its tokenizer."""
    src = FIXTURES / "tiny-qwen3-moe"
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and f.suffix != ".safetensors" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text()) | {"moe_intermediate_size": 64}
    (out / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    shapes = weight_map.hf_shapes(ModelConfig.from_hf_dir(out))
    tensors = {
        n: np.ones(s, np.float32) if n.endswith("norm.weight") else (rng.standard_normal(s) * 0.08).astype(np.float32)
        for n, s in shapes.items()
    }
    save_file(tensors, str(out / "model.safetensors"))
    return out


# ------------------------------------------------------------------------------------------ in-process checks
def test_shard_specs_follow_the_output_axes_and_whole_blocks():
    w = jnp.zeros((4, 64, 2, 96), jnp.float32)  # experts_gate_up [E, hidden, 2, I], split on I
    q8 = quantize_weight(w, "int8", 1)
    got = shard_specs(q8, P(None, None, None, "tp"), TP)
    assert got.q == P(None, None, None, "tp") and got.scale == P(None, None, "tp")  # scales [E, 2, I]
    blocks = quantize_q4_0(w, 1)  # data [E, 2, I, row_bytes]
    assert shard_specs(blocks, P(None, None, None, "tp"), TP).data == P(None, None, "tp", None)
    down = quantize_q4_0(jnp.zeros((4, 64, 32), jnp.float32), 1)  # experts_down [E, I, hidden], split on I = K
    assert shard_specs(down, P(None, "tp", None), TP).data == P(None, None, "tp")  # whole blocks of the rows
    with pytest.raises(ValueError, match=r"^layers\.3\.experts_down: its Q4_0 rows of 64 values split 4 ways into 16"):
        shard_specs(down, P(None, "tp", None), 4, "layers.3.experts_down")
    wo = quantize_weight(jnp.zeros((64, 32), jnp.float32))  # row-parallel: K split, scales whole
    assert shard_specs(wo, P("tp", None), TP).scale == P(None)


@pytest.mark.parametrize("name,qtype", [("tiny-qwen3", "Q8_0"), ("wide-moe", "Q4_0")])
def test_block_slices_dequantize_to_the_float_slices(name, qtype, tmp_path):
    """Every device's slice of every kept parameter (rows of its output axes, whole blocks along K), read from the
    file's blocks, de-quantizes to that slice of the parameter de-quantized whole."""
    src = (
        GGUF_DIR / "tiny-qwen3.gguf"
        if name == "tiny-qwen3"
        else to_gguf(wide_moe(tmp_path / "hf"), tmp_path / "f.gguf")
    )
    path = requantized(src, tmp_path / f"{qtype}.gguf", qtype)
    gf = GGUFFile(path)
    cfg = load_config(path)
    get, has = gguf_names.hf_view(gf, cfg)
    kept = weight_map.WeightReader(cfg, get, has, np.float32, keep_quantized=True).leaves()
    floats = weight_map.WeightReader(cfg, get, has, np.float32).leaves()
    logical = weight_map.param_specs(floats, cfg, TP)
    data_specs = weight_map.param_specs(kept, cfg, TP)
    is_leaf = lambda x: isinstance(x, parallel.LEAVES)  # noqa: E731
    flat_kept, tree = jax.tree.flatten(kept, is_leaf=is_leaf)
    others = (tree.flatten_up_to(t) for t in (floats, logical, data_specs))
    pairs = zip(flat_kept, *others, strict=True)
    n_split = 0
    for leaf, ref, spec, dspec in pairs:
        if not isinstance(leaf, weight_reads.BlocksLeaf):
            continue
        whole = ref.read_all()
        for d in range(TP):
            local = leaf.build(leaf.read(_shard(leaf.template.data.shape, dspec.data, d)))
            np.testing.assert_array_equal(np.asarray(local.dequantize()), whole[_shard(whole.shape, spec, d)])
        n_split += any(a is not None for a in spec)
    assert n_split >= 6 * cfg.num_layers  # every projection (and expert weight) is split


def _shard(shape: tuple[int, ...], spec: P, d: int) -> tuple[slice, ...]:
    """Device d's slice of an array of `shape` split by `spec` over TP devices."""
    axes = (*spec, *(None,) * (len(shape) - len(spec)))
    cut = [
        slice(0, n) if a is None else slice(d * n // TP, (d + 1) * n // TP) for a, n in zip(axes, shape, strict=True)
    ]
    return tuple(cut)


# ------------------------------------------------------------------------------------------ 2-device subprocess
@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return run_device_worker(__file__, tmp_path_factory.mktemp("quant-tp") / "results.json", devices=TP)


# online int4 and the GGUF Q4_0 file run on the MoE (experts and projections), the others on the dense model
CASES = ("tiny-qwen3 int8", "tiny-qwen3 fp8", "wide-moe int4", "tiny-qwen3 Q8_0", "wide-moe Q4_0")


def test_tp2_gives_tp1_logprobs_and_greedy_tokens(tp_results):
    for case in CASES:
        one, two = tp_results[case]["1"], tp_results[case]["2"]
        assert one["greedy"] == two["greedy"] and len(two["greedy"]) == GREEDY_TOKENS, case
        a, b = np.asarray(one["logprobs"], np.float32), np.asarray(two["logprobs"], np.float32)  # [tokens, top]
        assert a.shape == (GREEDY_TOKENS, LOGPROBS) and np.abs(a - b).max() < 2e-5, (case, np.abs(a - b).max())
        assert len(set(two["greedy"])) > 1, case  # not a degenerate repetition the comparison would not test


def test_tp2_weights_are_quantized_and_split(tp_results):
    for case in CASES:
        kinds = tp_results[case]["2"]["kinds"]
        method = case.split()[1]
        want = "QuantizedWeight" if method in ("int8", "fp8") else "GGMLWeight"
        names = ("wq", "wo", "experts_gate_up", "experts_down") if "moe" in case else ("wq", "wo", "w_down")
        for n in names:
            assert kinds[n]["type"] == want, (case, n, kinds[n])
            assert any("tp" in (s or []) for s in kinds[n]["specs"]), (case, n, kinds[n])  # split, not replicated


def test_quantizing_a_row_split_weight_gathers_nothing(tp_results):
    for method, c in tp_results["quantizer_collectives"].items():
        assert c["all-gather"] == [] and c["other"] == [], (method, c)
    assert tp_results["quantizer_collectives"]["int4"]["all-reduce"] == []  # blocks along K are local
    assert tp_results["quantizer_collectives"]["int8"]["all-reduce"]  # the per-channel maxima over K


def test_compiled_step_moves_no_weights(tp_results):
    """As in float: all-reduces of [.., hidden] partial sums (a GGML embedding's looked-up row as its bytes, the
    vocab-split gather's masked sum), and one all-gather, of the logits row."""
    for case in CASES:
        c = tp_results[case]["2"]["collectives"]
        method = case.split()[1]
        rows = {64} | ({row_bytes(method, 64)} if method in FORMATS else set())  # hidden 64
        assert all(shape[-1] in rows for shape in c["all-reduce"]), (case, c)
        assert c["all-gather"] == [[1, 512]], (case, c)
        assert c["other"] == [], (case, c)


def test_blocks_that_do_not_split_are_refused_naming_the_weight(tp_results):
    for case in ("tiny-qwen3-moe int4", "tiny-qwen3-moe Q8_0"):
        err = tp_results["refused"][case]
        assert "experts_down" in err and "split 2 ways into 16" in err and "\n" not in err, (case, err)


# ------------------------------------------------------------------------------------------ the worker
def _worker(out_path: str) -> None:
    import tempfile

    from test_tensor_parallel import _collectives

    from netra_jax import LLM, SamplingParams
    from netra_jax.quant.online import sharded_quantizer

    assert len(jax.devices()) == TP
    tmp = Path(tempfile.mkdtemp())
    wide = wide_moe(tmp / "wide-moe")
    models = {
        "tiny-qwen3": (FIXTURES / "tiny-qwen3", GGUF_DIR / "tiny-qwen3.gguf"),
        "wide-moe": (wide, to_gguf(wide, tmp / "wide-moe.gguf")),
        "tiny-qwen3-moe": (FIXTURES / "tiny-qwen3-moe", GGUF_DIR / "tiny-qwen3-moe.gguf"),
    }

    tokenizers = {name: str(hf) for name, (hf, _) in models.items()}  # a converted file carries none

    def model(name: str, method: str) -> tuple[str, str | None]:
        hf, gguf_file = models[name]
        if method.startswith("Q"):
            return str(requantized(gguf_file, tmp / f"{name}-{method}.gguf", method)), None
        return str(hf), method

    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True, logprobs=LOGPROBS)
    opts = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, num_kv_pages=16, warmup=False)
    results: dict = {"refused": {}}
    for case in CASES:
        path, method = model(*case.split())
        results[case] = {}
        for tp in (1, TP):
            # one device on float activations ("cpu_rows"): the arithmetic of the split jnp reference ("auto" under
            # tensor parallelism), where the one-device default rounds a GGUF file's activations to int8
            llm = LLM(
                path,
                quantization=method,
                tensor_parallel_size=tp,
                tokenizer=tokenizers[case.split()[0]],
                matmul_backend="cpu_rows" if tp == 1 else "auto",
                **opts,
            )
            out = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0].outputs[0]
            r: dict = {"greedy": out.token_ids}
            r["logprobs"] = [sorted((p.logprob for p in step.values()), reverse=True) for step in out.logprobs]
            if tp > 1:
                runner = llm.engine.runner
                lp = next(lp for lp in runner.params["layers"] if "wq" in lp and ("router" in lp or "w_down" in lp))
                r["kinds"] = {
                    k: {"type": type(w).__name__, "specs": [list(a.sharding.spec) for a in jax.tree.leaves(w)]}
                    for k, w in lp.items()
                }
                shape = runner.shape_for(1)  # the decode step
                buf = jnp.zeros(shape.packed_len(), jnp.int32)
                lowered = runner._jit.lower(
                    runner.params, runner.kv, buf, cfg=runner.cfg, shape=shape, backend=runner.backend
                )
                r["collectives"] = _collectives(lowered.compile().as_text())
            results[case][str(tp)] = r
            del llm
    for case in ("tiny-qwen3-moe int4", "tiny-qwen3-moe Q8_0"):
        path, method = model(*case.split())
        try:
            LLM(path, quantization=method, tensor_parallel_size=TP, tokenizer=tokenizers[case.split()[0]], **opts)
            results["refused"][case] = ""
        except ValueError as e:
            results["refused"][case] = str(e)
    # a row-parallel weight (K split) quantized where it lies
    mesh = parallel.make_mesh(TP)
    w = jax.device_put(jnp.ones((128, 64), jnp.float32), jax.sharding.NamedSharding(mesh, P("tp", None)))
    results["quantizer_collectives"] = {
        m: _collectives(sharded_quantizer("wo", w, m).lower(w).compile().as_text()) for m in ("int8", "int4", "fp8")
    }
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    _worker(sys.argv[1])
