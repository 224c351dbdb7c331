"""The multi-LoRA segment matmul (`ops.lora_segment`: tokens sorted by slot, shrink and expand on the grouped-matmul
kernel) interpreted on CPU against `models.lora.lora_delta`'s jnp reference and a float64 product: random slots with
tokens of no adapter, every token on one slot, no adapters, one token, ragged row blocks, narrow and wide ranks,
float32 and bfloat16; each token's delta bit for bit the same whatever its neighbours' slots; one program for every
mix; the matmul backend picking the path, through the forward too; and, where the CUDA wheels are installed (`make
gpu-compile-setup`), the GPU path compiled without a GPU for the H200 and A100, its two kernels within their budget
and spilling nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from netra_jax.models.lora import lora_delta
from netra_jax.ops.grouped_matmul_triton import (
    GroupedMatmulConfig,
    grouped_matmul_reference,
    grouped_matmul_triton_interpret,
)
from netra_jax.ops.lora_segment import lora_segment_delta_interpret, segment_configs, sort_by_slot

REPO = Path(__file__).resolve().parents[2]
CUDA_SITE = Path(os.environ.get("NETRA_JAX_CUDA_SITE") or REPO / ".venv" / "cuda13").resolve()
HAVE_CUDA = (CUDA_SITE / "jax_plugins" / "xla_cuda13").is_dir()


def _case(T: int, S: int, Rg: int, fan_in: int, fan_out: int, slots, seed: int, dtype=jnp.float32):
    """x [T, in], (a [in, S, Rg], b [S, Rg, out]), slots [T] as jax arrays, and the float64 delta of the factors as
    stored in `dtype` (each token's x @ a[:, s] @ b[s], zero for slot -1)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, fan_in)), dtype)
    a = jnp.asarray(rng.normal(size=(fan_in, S, Rg)) / np.sqrt(fan_in), dtype)
    b = jnp.asarray(rng.normal(size=(S, Rg, fan_out)) / np.sqrt(Rg), dtype)
    if isinstance(slots, str):
        slots = {"random": rng.integers(-1, S, T), "one": np.full(T, S - 1), "none": np.full(T, -1)}[slots]
    slots = jnp.asarray(slots, jnp.int32)
    x64, a64, b64 = (np.asarray(v, np.float64) for v in (x, a, b))
    s = np.asarray(slots)
    want = np.zeros((T, fan_out))
    for t in np.flatnonzero(s >= 0):
        want[t] = x64[t] @ a64[:, s[t]] @ b64[s[t]]
    return x, (a, b), slots, want


CASES = {  # T, S, Rg, in, out, slots
    "random_slots_and_none": (37, 4, 48, 64, 96, "random"),
    "every_token_one_slot": (20, 3, 16, 40, 50, "one"),
    "no_adapters": (13, 2, 24, 32, 40, "none"),
    "one_token": (1, 4, 16, 48, 64, "random"),
    "rank_192_ragged_blocks": (70, 2, 192, 48, 80, "random"),
    "many_slots_few_tokens": (9, 8, 32, 24, 130, "random"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float32_matches_the_reference(name):
    T, S, Rg, fan_in, fan_out, slots = CASES[name]
    x, group, slots, want = _case(T, S, Rg, fan_in, fan_out, slots, seed=T + S)
    got = lora_segment_delta_interpret(x, group, slots)
    ref = np.asarray(lora_delta(x, group, slots))
    assert got.shape == (T, fan_out) and got.dtype == jnp.float32
    got = np.asarray(got)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * scale)
    none = np.asarray(slots) < 0
    assert not got[none].any() and not ref[none].any()  # tokens of the base model: exact zeros


@pytest.mark.parametrize("name", ["random_slots_and_none", "rank_192_ragged_blocks", "every_token_one_slot"])
def test_bfloat16_matches_the_reference(name):
    """bf16 operands, float32 accumulation, the [T, Rg] intermediate rounded to bf16 as the reference's: within
    a few bf16 roundings of the output's scale."""
    T, S, Rg, fan_in, fan_out, slots = CASES[name]
    x, group, slots, want = _case(T, S, Rg, fan_in, fan_out, slots, seed=T, dtype=jnp.bfloat16)
    got = lora_segment_delta_interpret(x, group, slots)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    ref = np.asarray(lora_delta(x, group, slots), np.float32)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * scale)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * scale)
    assert not got[np.asarray(slots) < 0].any()


def test_factors_wider_than_the_activations_are_cast_per_tile():
    """float32 slots under bf16 activations (what a runner compiled for a target holds): the factors are cast to
    bf16 as the reference casts them, tile by tile."""
    x, (a, b), slots, _ = _case(24, 3, 32, 64, 48, "random", seed=4)
    x = x.astype(jnp.bfloat16)
    got = np.asarray(lora_segment_delta_interpret(x, (a, b), slots), np.float32)
    ref = np.asarray(lora_delta(x, (a, b), slots), np.float32)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_tokens_delta_does_not_depend_on_its_neighbours(dtype):
    """Tokens 0-5 keep their slots while every other token's slot changes (all on one slot, none, random, all on
    the slots of tokens 0-5): their deltas stay bit for bit the same, though their places in the sorted rows and
    row blocks move. Bitwise here because the kernel computes each output element from its own row and its slot's
    columns only, accumulated over K in the same steps wherever the row sits."""
    T, S = 45, 4
    x, group, _, _ = _case(T, S, 48, 64, 72, "random", seed=11, dtype=dtype)
    keep = np.array([0, 3, -1, 1, 2, 3])
    rng = np.random.default_rng(5)
    mixes = [
        np.full(T - 6, 0),
        np.full(T - 6, -1),
        rng.integers(-1, S, T - 6),
        rng.integers(-1, S, T - 6),
        np.resize(keep, T - 6),
    ]
    outs = []
    for rest in mixes:
        slots = jnp.asarray(np.concatenate([keep, rest]), jnp.int32)
        outs.append(np.asarray(lora_segment_delta_interpret(x, group, slots)[:6]))
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])


def test_one_program_for_every_mix_and_rank():
    """The slots' contents (adapters of smaller rank zero-padded, some cleared) and the tokens' slots are data:
    one compiled program for all of them."""
    T, S, Rg, fan_in, fan_out = 24, 3, 32, 40, 56
    x, (a, b), _, _ = _case(T, S, Rg, fan_in, fan_out, "random", seed=2)
    step = jax.jit(lambda x, group, slots: lora_delta(x, group, slots, "gpu_interpret"))
    rng = np.random.default_rng(0)
    small = (a.at[:, :, 8:].set(0), b.at[:, 8:].set(0))  # every slot holding a rank-8 adapter
    cleared = (a.at[:, 1].set(0), b.at[1].set(0))
    for group in ((a, b), small, cleared):
        for slots in (rng.integers(-1, S, T), np.full(T, -1), np.full(T, 2)):
            slots = jnp.asarray(slots, jnp.int32)
            got = np.asarray(step(x, group, slots))
            np.testing.assert_allclose(got, np.asarray(lora_delta(x, group, slots)), rtol=1e-4, atol=1e-4)
    assert step._cache_size() == 1


def test_the_matmul_backend_picks_the_path():
    """The GPU backends run the grouped kernel ("gpu_interpret" in the interpreter); "xla" and the CPU kernels'
    backends the reference, the default."""
    x, group, slots, _ = _case(8, 2, 16, 16, 16, "random", seed=1)

    def has_kernel(backend):
        return "pallas_call" in str(jax.make_jaxpr(lambda *a: lora_delta(*a, backend))(x, group, slots))

    assert has_kernel("gpu_interpret") and has_kernel("gpu") and has_kernel("gpu_sm80")
    assert not has_kernel("xla") and not has_kernel("cpu_rows") and not has_kernel("cpu_rows_q8")
    assert "pallas_call" not in str(jax.make_jaxpr(lora_delta)(x, group, slots))


def test_the_forward_passes_its_matmul_backend_to_the_deltas():
    """A tiny Llama with a PEFT adapter in slot 1 of 3, every group of both layers: the forward on "gpu_interpret"
    (the deltas on the interpreted kernel) gives the logits of the reference path."""
    from support.checkpoints import DATA, FIXTURES, reference

    from netra_jax.loader import load_model
    from netra_jax.models import lora as L
    from netra_jax.models.transformer import forward_dense

    cfg, params = load_model(FIXTURES / "tiny-llama", dtype="float32", cache=False)
    adapter = L.load_peft_adapter(DATA / "lora" / "llama-all-r8", cfg)
    slots = L.set_slot(cfg, L.empty_slots(cfg, 3, 16), 1, adapter)
    ids = jnp.asarray(reference("tiny-llama")["cases"][1]["prompt_ids"], jnp.int32)
    got = np.asarray(forward_dense(params, cfg, ids, lora=slots, lora_slot=1, matmul_backend="gpu_interpret"))
    want = np.asarray(forward_dense(params, cfg, ids, lora=slots, lora_slot=1))
    base = np.asarray(forward_dense(params, cfg, ids))
    assert np.abs(want - base).max() > 1e-2  # the adapter changes the logits, or the comparison shows nothing
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_sort_by_slot():
    """Stable by slot, tokens without an adapter (-1 or out of range) last; group sizes count each slot's tokens."""
    slots = jnp.asarray([2, -1, 0, 2, 5, 0, -1, 1], jnp.int32)
    order, sizes = sort_by_slot(slots, 3)
    assert np.asarray(order).tolist() == [2, 5, 7, 0, 3, 1, 4, 6]
    assert np.asarray(sizes).tolist() == [2, 1, 2]


def test_the_grouped_kernel_reads_factors_with_the_group_axis_second():
    """grouped_matmul_triton(group_axis=1) on w [K, G, N] is the [G, K, N] product of its transpose, read in place;
    rows past the groups come out zero; any other axis is refused."""
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.normal(size=(29, 40)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(40, 3, 24)), jnp.float32)  # [K, G, N]
    sizes = jnp.asarray([7, 0, 15], jnp.int32)  # 22 of 29 rows in groups
    cfg = GroupedMatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=2)
    got = np.asarray(grouped_matmul_triton_interpret(rows, w, sizes, group_axis=1, config=cfg))
    want = np.asarray(grouped_matmul_reference(rows, jnp.transpose(w, (1, 0, 2)), sizes))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not got[22:].any()
    with pytest.raises(ValueError, match="group_axis"):
        grouped_matmul_triton_interpret(rows, w, sizes, group_axis=2)
    with pytest.raises(ValueError, match="shapes"):
        grouped_matmul_triton_interpret(rows, w[:, :2], sizes, group_axis=1)


@pytest.mark.parametrize("rank", [16, 24, 48, 64, 128, 192])
def test_launch_configurations_for_every_rank(rank):
    """Every slot rank from 16 to 192 (Rg, the narrow side: the shrink's N, the expand's K) and every step size gets
    valid tiles no wider than the power of two holding Rg (at least 16: Triton's smallest dot)."""
    for T in (1, 8, 256, 2048):
        for dtype in (jnp.bfloat16, jnp.float32):
            shrink, expand = segment_configs(T, 4, 4096, rank, 6144, dtype)
            shrink.validate()
            expand.validate()
            fit = max(16, 1 << (rank - 1).bit_length())
            assert shrink.block_n <= fit and expand.block_k <= fit
            assert shrink.block_m == expand.block_m  # both products cut the same sorted rows alike


# ------------------------------------------------------------------ the GPU path compiled without a GPU

_COMPILE = r"""
import json, os, sys, tempfile
from benchmarks.gpu_compile import capture
dump = tempfile.mkdtemp(prefix="lora-segment-")
os.environ.update(capture.compiler_env(dump))
import jax, jax.numpy as jnp
from netra_jax.targets import compile_device
from netra_jax.models.lora import lora_delta

for target, backend in (("h200", "gpu"), ("a100", "gpu_sm80")):
    dev = compile_device(target)
    on = jax.sharding.SingleDeviceSharding(dev)
    for T, S, Rg, fan_in, fan_out, dtype in json.loads(sys.argv[1]):
        dt = jnp.dtype(dtype)
        args = (
            jax.ShapeDtypeStruct((T, fan_in), dt, sharding=on),
            (jax.ShapeDtypeStruct((fan_in, S, Rg), dt, sharding=on),
             jax.ShapeDtypeStruct((S, Rg, fan_out), dt, sharding=on)),
            jax.ShapeDtypeStruct((T,), jnp.int32, sharding=on),
        )

        def kernel_case(x, group, slots):  # the module name selects the dumped thunk sequence (dynamic smem)
            return lora_delta(x, group, slots, backend)

        before = capture.dumped(dump)
        row = {"target": target, "case": [T, S, Rg, fan_in, fan_out, dtype]}
        with capture.captured() as out:
            try:
                with jax.default_device(dev):
                    compiled = jax.jit(kernel_case).lower(*args).compile()
                row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        if "error" not in row:
            launched = capture.thunk_smem(dump, before)
            row["kernels"] = []
            for k in capture.ptxas_reports(out.text):
                if k.name.startswith("grouped_matmul"):
                    k.dynamic_smem = launched.get(k.name)
                    row["kernels"].append(k.as_dict())
        print("ROW " + json.dumps(row), flush=True)
"""

# llama3-8b's groups at ranks 16 and 64 with 4 slots: qkv decode, qkv prefill, the o group (Rg 16), float32
COMPILE_CASES = [
    (8, 4, 48, 4096, 6144, "bfloat16"),
    (2048, 4, 192, 4096, 6144, "bfloat16"),
    (256, 8, 16, 4096, 4096, "bfloat16"),
    (256, 8, 16, 4096, 4096, "float32"),
]


@pytest.mark.slow
@pytest.mark.skipif(
    not HAVE_CUDA,
    reason=f"the CUDA 13 wheels are not installed in {CUDA_SITE} (`make gpu-compile-setup`; CI installs them)",
)
def test_the_gpu_path_compiles_for_h200_and_a100_without_spills(tmp_path):
    """Deviceless compile (a separate process: only it imports the CUDA plugin) of lora_delta on the "gpu"
    backend for the H200 and "gpu_sm80" for the A100: two grouped-matmul kernels per program (shrink and expand,
    not XLA's dense product over every slot), each within the kernel's register and shared-memory budget, none
    spilling."""
    from netra_jax.ops.grouped_matmul_triton import GPU_BUDGET

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CUDA_SITE), str(REPO)]), PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(COMPILE_CASES)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    rows = [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("ROW ")]
    assert r.returncode == 0 and len(rows) == 2 * len(COMPILE_CASES), r.stdout[-3000:] + r.stderr[-3000:]
    for row in rows:
        assert "error" not in row, row
        kernels = row["kernels"]
        assert len(kernels) == 2, row
        for k in kernels:
            assert 0 < k["registers"] <= GPU_BUDGET.registers, row
            assert k["spill_bytes"] == 0, row
            assert k["smem_bytes"] is not None and 0 < k["smem_bytes"] <= GPU_BUDGET.smem_bytes, row
