"""The Triton tree-attention kernel against the reference (trtssd.models.attention).

CPU: the kernel runs under Triton's interpreter in ONE child process started with
TRITON_INTERPRET=1 (Triton fixes its mode when it is first imported, so the variable must be
set before that, which a child process guarantees whatever else this pytest run imported).
The child is this file run as a script: it reads case specs as JSON on stdin and prints the
errors as JSON. Also on CPU: the kernels compile to PTX for sm_90 (no GPU needed for that).
GPU (@pytest.mark.gpu, skipped without CUDA): the compiled kernel in bf16/fp16/fp32 on
Llama-like shapes, the CUDA dispatch of ``tree_attention``, and the TensorRT plugin if
tensorrt is installed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # plugins/ is not an installed package; `python -m pytest` adds it, bare pytest not
    sys.path.insert(0, str(REPO))
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 3e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# ---------------------------------------------------------------------------------------------
# Region masks: [n, R] bool, query i may see region slot r. Every query sees its own slot.
# ---------------------------------------------------------------------------------------------


def chain_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random tree in topological order: node i sees itself and its ancestors."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if i:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[i] |= mask[parent]
    return mask


def forest_mask(glue: int, branches: int, depth: int) -> torch.Tensor:
    """SSD's tree step: a shared glue chain, then ``branches`` chains that each see the glue."""
    n = glue + branches * depth
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:glue, :glue] = chain_mask(glue)
    for f in range(branches):
        lo = glue + f * depth
        mask[lo : lo + depth, :glue] = True
        mask[lo : lo + depth, lo : lo + depth] = chain_mask(depth)
    return mask


def scratch_mask(n: int, region: int, gen: torch.Generator) -> torch.Tensor:
    """Queries live at scattered slots of a wider region and see random earlier slots."""
    own = torch.randperm(region, generator=gen)[:n].sort().values
    mask = torch.rand(n, region, generator=gen) < 0.4
    mask &= torch.arange(region)[None, :] <= own[:, None]
    mask[torch.arange(n), own] = True
    return mask


def region_masks(spec: dict) -> torch.Tensor:
    """[B, n, R] masks for a case; trees differ per sequence."""
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    kind, B, n = spec["mask"], len(spec["prefix"]), spec["n"]
    if kind == "chain":
        masks = [chain_mask(n)] * B
    elif kind == "tree":
        masks = [tree_mask(n, gen) for _ in range(B)]
    elif kind == "forest":
        glue, branches, depth = spec["forest"]
        masks = [forest_mask(glue, branches, depth)] * B
    elif kind == "scratch":
        masks = [scratch_mask(n, spec["region"], gen) for _ in range(B)]
    else:
        raise ValueError(f"unknown mask kind {kind!r}")
    return torch.stack(masks)


def case_tensors(spec: dict, device: str):
    """Random q, k, v, prefix_len, region_mask for a case (strided views when asked)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    dtype = DTYPES[spec["dtype"]]
    B, H, Hkv, n, D, S = len(spec["prefix"]), spec["H"], spec["Hkv"], spec["n"], spec["D"], spec["S"]
    if spec.get("strided"):
        # q as a head-transposed view, k/v as the first S slots of a longer cache.
        q = torch.randn(B, n, H, D, generator=gen).transpose(1, 2)
        k = torch.randn(B, Hkv, S + 7, D, generator=gen)[:, :, :S]
        v = torch.randn(B, Hkv, S + 7, D, generator=gen)[:, :, :S]
    else:
        q, k, v = (torch.randn(B, h, m, D, generator=gen) for h, m in ((H, n), (Hkv, S), (Hkv, S)))
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    prefix_len = torch.tensor(spec["prefix"], dtype=torch.int64, device=device)
    return q, k, v, prefix_len, region_masks(spec).to(device)


def run_case(spec: dict, device: str) -> dict:
    """Kernel vs reference for one case; returns the max abs error and the output scale."""
    from trtssd.models.attention import tree_attention_reference
    from trtssd.kernels.packed_mask import pack_mask
    from trtssd.kernels.tree_attention_triton import KernelConfig, tree_attention_packed, tree_attention_triton

    q, k, v, prefix_len, mask = case_tensors(spec, device)
    config = KernelConfig(**spec["config"]) if spec.get("config") else None
    if spec.get("pool"):
        # k, v become a KV pool with spare rows; sequence b lives in row rows[b].
        B = q.shape[0]
        rows = torch.randperm(B + 3, generator=torch.Generator().manual_seed(spec["seed"]))[:B].to(device)
        k_pool = torch.randn(B + 3, *k.shape[1:], generator=torch.Generator().manual_seed(99)).to(k)
        v_pool = torch.randn_like(k_pool)
        k_pool[rows], v_pool[rows] = k, v
        out = tree_attention_triton(q, k_pool, v_pool, prefix_len, mask, spec.get("scale"), kv_rows=rows, config=config)
    elif spec.get("garbage_bits"):
        # Bits at or past region_len must be ignored: set every spare bit of the last word.
        words = pack_mask(mask)
        R = mask.shape[2]
        spare = torch.ones(*mask.shape[:2], words.shape[2] * 32 - R, dtype=torch.bool, device=mask.device)
        words = pack_mask(torch.cat([mask, spare], dim=2))
        out = tree_attention_packed(q, k, v, prefix_len, words, R, spec.get("scale"), config=config)
    else:
        out = tree_attention_triton(q, k, v, prefix_len, mask, spec.get("scale"), config=config)
    ref = tree_attention_reference(q, k, v, prefix_len, mask, spec.get("scale"))
    return {
        "name": spec["name"],
        "max_err": (out.float() - ref.float()).abs().max().item(),
        "ref_max": ref.float().abs().max().item(),
        "finite": bool(torch.isfinite(out).all()),
    }


def spec(name, *, H, Hkv, n, D, S, prefix, mask, dtype="float32", seed=0, **extra) -> dict:
    return dict(name=name, H=H, Hkv=Hkv, n=n, D=D, S=S, prefix=prefix, mask=mask, dtype=dtype, seed=seed, **extra)


SMALL = dict(block_m=16, block_n=16, num_splits=1)
CPU_CASES = [
    spec("chain-mha", H=2, Hkv=2, n=4, D=16, S=48, prefix=[0, 37], mask="chain"),
    spec("chain-decode-n1", H=1, Hkv=1, n=1, D=64, S=40, prefix=[1, 30], mask="chain", seed=1),
    spec("tree-gqa4", H=8, Hkv=2, n=7, D=32, S=64, prefix=[5, 50, 17], mask="tree", seed=2),
    spec("tree-gqa4-small-blocks", H=8, Hkv=2, n=7, D=32, S=64, prefix=[5, 50, 17], mask="tree", seed=2, config=SMALL),
    spec("forest-mqa", H=4, Hkv=1, n=12, D=16, S=40, prefix=[9, 0], mask="forest", forest=(0, 4, 3), seed=3),
    spec("forest-glue-row-blocks", H=4, Hkv=1, n=14, D=16, S=40, prefix=[9, 20], mask="forest",
         forest=(2, 4, 3), seed=4, config=SMALL),
    spec("scratch-wide-region", H=4, Hkv=2, n=6, D=16, S=64, prefix=[3, 33], mask="scratch", region=20, seed=5),
    spec("region-past-cache-end", H=2, Hkv=1, n=5, D=16, S=30, prefix=[24, 2], mask="scratch", region=20, seed=6),
    spec("head-dim-8-padded", H=4, Hkv=2, n=5, D=8, S=32, prefix=[4, 11], mask="tree", seed=7, scale=0.3),
    spec("splits-3", H=8, Hkv=2, n=6, D=16, S=100, prefix=[0, 90], mask="tree", seed=8,
         config=dict(block_m=32, block_n=16, num_splits=3)),
    spec("splits-empty", H=4, Hkv=2, n=3, D=16, S=40, prefix=[3, 10], mask="chain", seed=9,
         config=dict(block_m=16, block_n=16, num_splits=8)),
    spec("strided-views", H=4, Hkv=2, n=5, D=16, S=33, prefix=[7, 20], mask="tree", seed=10, strided=True),
    spec("kv-pool-rows", H=4, Hkv=2, n=5, D=16, S=40, prefix=[6, 30, 12], mask="tree", seed=15, pool=True),
    spec("garbage-spare-bits", H=2, Hkv=1, n=5, D=16, S=40, prefix=[6, 12], mask="tree", seed=11, garbage_bits=True),
    spec("fp16-forest", H=8, Hkv=2, n=10, D=32, S=48, prefix=[12, 30], mask="forest", forest=(2, 4, 2),
         dtype="float16", seed=12),
    spec("bf16-tree", H=8, Hkv=2, n=7, D=32, S=48, prefix=[12, 30], mask="tree", dtype="bfloat16", seed=13),
    spec("bf16-splits", H=4, Hkv=1, n=4, D=16, S=64, prefix=[40, 55], mask="chain", dtype="bfloat16", seed=14,
         config=dict(block_m=16, block_n=16, num_splits=4)),
]  # fmt: skip


def run_interpreter_child(cases: list[dict]) -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, __file__], input=json.dumps(cases), capture_output=True, text=True, env=env,
        cwd=REPO, timeout=300,
    )  # fmt: skip
    if proc.returncode:
        pytest.fail(f"interpreter child failed:\n{proc.stderr[-4000:]}")
    return {r["name"]: r for r in json.loads(proc.stdout)}


@pytest.fixture(scope="module")
def interpreter_results():
    pytest.importorskip("triton")
    return run_interpreter_child(CPU_CASES)


@pytest.mark.parametrize("case", CPU_CASES, ids=[c["name"] for c in CPU_CASES])
def test_interpreter_matches_reference(interpreter_results, case):
    result = interpreter_results[case["name"]]
    assert result["finite"], result
    assert result["ref_max"] > 0.1, "degenerate case: the reference output is ~0"
    assert result["max_err"] <= TOLERANCE[case["dtype"]], result


# ---------------------------------------------------------------------------------------------
# Host-side logic and compilation (CPU, no interpreter)
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_are_rejected():
    pytest.importorskip("triton")
    from trtssd.kernels.tree_attention_triton import KernelConfig, tree_attention_triton

    q, k, v = torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    prefix, mask = torch.tensor([3]), torch.ones(1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        tree_attention_triton(q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16), prefix, mask)
    with pytest.raises(ValueError, match="share a dtype"):
        tree_attention_triton(q, k.half(), v.half(), prefix, mask)
    with pytest.raises(ValueError, match="prefix_len"):
        tree_attention_triton(q, k, v, torch.tensor([3, 4]), mask)
    with pytest.raises(ValueError, match="region_mask"):
        tree_attention_triton(q, k, v, prefix, mask.int())
    with pytest.raises(ValueError, match="mask words"):
        tree_attention_triton(q, k, v, prefix, torch.ones(1, 3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_n"):
        KernelConfig(block_n=24)
    with pytest.raises(ValueError, match="num_splits"):
        KernelConfig(num_splits=0)


def test_dispatch_with_kv_rows_gathers_the_pool_rows():
    from trtssd.models.attention import tree_attention, tree_attention_reference

    gen = torch.Generator().manual_seed(0)
    q, pool_k, pool_v = (torch.randn(*s, generator=gen) for s in ((2, 4, 3, 8), (5, 2, 20, 8), (5, 2, 20, 8)))
    rows, prefix, mask = torch.tensor([3, 1]), torch.tensor([4, 9]), chain_mask(3).expand(2, 3, 3)
    out = tree_attention(q, pool_k, pool_v, prefix, mask, kv_rows=rows)
    assert torch.equal(out, tree_attention_reference(q, pool_k[rows], pool_v[rows], prefix, mask))


def test_loader_falls_back_when_triton_is_missing(monkeypatch):
    import trtssd.kernels as kernels

    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.delitem(sys.modules, "trtssd.kernels.tree_attention_triton", raising=False)
    kernels.load_tree_attention_kernel.cache_clear()
    try:
        assert kernels.load_tree_attention_kernel() is None
    finally:
        kernels.load_tree_attention_kernel.cache_clear()


def test_cpu_tensors_without_interpreter_get_a_clear_error():
    pytest.importorskip("triton")
    from trtssd.kernels.tree_attention_triton import interpreter_active, tree_attention_triton

    if interpreter_active():
        pytest.skip("this process runs Triton's interpreter")
    q, k, v = torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        tree_attention_triton(q, k, v, torch.tensor([3]), torch.ones(1, 2, 2, dtype=torch.bool))


def test_default_config_fills_the_gpu_with_splits_only_when_needed():
    pytest.importorskip("triton")
    from trtssd.kernels.tree_attention_triton import Problem, default_config

    verify_b1 = Problem(batch=1, num_heads=32, num_kv_heads=8, num_queries=8, head_dim=128, num_slots=8192,
                        region_len=8)  # fmt: skip
    config = default_config(verify_b1, sm_count=132)
    assert config.block_m == 32  # 4 query heads x 8 tokens: one program per kv head
    assert config.num_splits > 1  # 8 programs alone would leave 124 SMs idle
    busy = Problem(batch=64, num_heads=32, num_kv_heads=8, num_queries=8, head_dim=128, num_slots=8192, region_len=8)
    assert default_config(busy, sm_count=132).num_splits == 1
    tree = Problem(batch=1, num_heads=32, num_kv_heads=8, num_queries=64, head_dim=64, num_slots=512, region_len=64)
    assert default_config(tree, sm_count=132).block_m == 128  # capped; 256 rows -> 2 row blocks
    assert default_config(verify_b1, sm_count=None).num_splits == 1  # interpreter


def _compile_for_hopper(fn, signature: dict, constexprs: dict, num_warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    jit = JITFunction(fn)
    for name in constexprs:
        signature[name] = "constexpr"
    source = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "enable_fp_fusion": True}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def test_split_path_and_combine_compile_for_sm90():
    """The CUDA launch path (not only the interpreter) must survive Triton's compiler."""
    pytest.importorskip("triton")
    from plugins.tree_attention.trt_plugin import SCALAR_ARGS
    from trtssd.kernels import tree_attention_triton as kt

    if kt.interpreter_active():
        pytest.skip("this process runs Triton's interpreter")
    sig = {name: "*bf16" for name in ("Q", "K", "V")} | {"PrefixLen": "*i64", "MaskWords": "*i32", "KvRows": "*i64"}
    sig |= {name: "i32" for name in SCALAR_ARGS} | {"Out": "*bf16", "PartAcc": "*fp32", "PartStats": "*fp32"}
    consts = dict(SCALE_LOG2=0.18, BLOCK_M=32, BLOCK_N=64, BLOCK_D=128, NUM_SPLITS=4, INPUT_PRECISION=None,
                  WIDEN_DOT=False)  # fmt: skip
    fwd = _compile_for_hopper(kt.tree_attention_fwd, sig, consts)
    assert ".entry tree_attention_fwd" in fwd.asm["ptx"]
    sig = {"PartAcc": "*fp32", "PartStats": "*fp32", "stride_ob": "i32", "stride_oh": "i32", "stride_on": "i32",
           "num_queries": "i32", "num_kv_heads": "i32", "group_size": "i32", "head_dim": "i32", "Out": "*bf16"}
    combine = _compile_for_hopper(kt.tree_attention_combine, sig, dict(BLOCK_M=32, BLOCK_D=128, NUM_SPLITS=4))
    assert ".entry tree_attention_combine" in combine.asm["ptx"]


def test_aot_kernel_declares_exactly_the_tensorrt_arguments():
    pytest.importorskip("triton")
    from plugins.tree_attention.trt_plugin import SCALAR_ARGS, TENSOR_INPUTS, compile_aot_kernel
    from trtssd.kernels.tree_attention_triton import interpreter_active

    if interpreter_active():
        pytest.skip("this process runs Triton's interpreter")
    kernel = compile_aot_kernel("bfloat16", 128, 0.125)
    header = kernel.ptx[kernel.ptx.index(".entry") :]
    header = header[: header.index(")")]
    assert header.count(".param") == len(TENSOR_INPUTS) + len(SCALAR_ARGS) + 1  # inputs, scalars, out
    assert kernel.num_warps == 4 and kernel.shared_mem <= 48 * 1024  # default fits static smem


def test_drop_unused_trailing_params():
    from plugins.tree_attention.trt_plugin import drop_unused_trailing_params

    ptx = (
        ".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1,\n\t.param .u64 k_param_2\n)\n"
        "{\n\tld.param.b64 %rd1, [k_param_0];\n\tld.param.b32 %r1, [k_param_1];\n}\n"
    )
    trimmed = drop_unused_trailing_params(ptx, "k", 2)
    assert "k_param_2" not in trimmed and "k_param_1" in trimmed
    with pytest.raises(ValueError, match="used by the kernel body"):
        drop_unused_trailing_params(ptx, "k", 1)
    with pytest.raises(ValueError, match="expected at least"):
        drop_unused_trailing_params(ptx, "k", 4)


def test_plugin_scalar_args_match_contiguous_strides():
    """The plugin derives strides from shapes; they must be torch's contiguous strides."""
    from plugins.tree_attention.trt_plugin import SCALAR_ARGS, kernel_scalar_args, launch_grid

    q, k, m = torch.empty(2, 8, 5, 16), torch.empty(2, 2, 30, 16), torch.empty(2, 5, 3, dtype=torch.int32)
    args = dict(zip(SCALAR_ARGS, kernel_scalar_args(q.shape, k.shape, m.shape)))
    assert (args["stride_qb"], args["stride_qh"], args["stride_qn"]) == q.stride()[:3]
    assert (args["stride_kb"], args["stride_kh"], args["stride_ks"]) == k.stride()[:3]
    assert (args["stride_mb"], args["stride_mn"]) == m.stride()[:2]
    assert (args["group_size"], args["region_len"], args["num_slots"]) == (4, 96, 30)
    assert launch_grid(q.shape, k.shape, 16, lambda a, b: -(-a // b)) == (4, 2, 1)


def test_plugin_glue_with_a_stand_in_tensorrt(monkeypatch):
    """register_tree_attention_plugin against a minimal stand-in for tensorrt.plugin (the real
    one cannot be installed here): the AOT callback must compile and describe a full launch."""
    pytest.importorskip("triton")
    import types

    from plugins.tree_attention import trt_plugin
    from trtssd.kernels.tree_attention_triton import interpreter_active

    if interpreter_active():
        pytest.skip("this process runs Triton's interpreter")

    class Dim(int):  # a static shape expression
        is_constant = True

        def constant_value(self):
            return int(self)

    registered = {}

    def decorator(kind):
        return lambda plugin_id: (lambda fn: registered.setdefault((kind, plugin_id), fn))

    trt = types.ModuleType("tensorrt")
    trt.float16, trt.bfloat16, trt.float32 = "f16", "bf16", "f32"
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.op = types.SimpleNamespace()
    trtp.register, trtp.autotune, trtp.aot_impl = decorator("register"), decorator("autotune"), decorator("aot")
    trtp.TensorDesc = trtp.AutoTuneCombination = trtp.SymExprs = object
    trtp.KernelLaunchParams = types.SimpleNamespace
    trtp.SymInt32 = int
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=tuple)
    trtp.cdiv = lambda a, b: -(-a // b)
    trt.plugin = trtp
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)

    trt_plugin.register_tree_attention_plugin(trt_plugin.AotOptions(block_m=16))
    assert {kind for kind, _ in registered} == {"register", "autotune", "aot"}

    def desc(shape, dtype):
        return types.SimpleNamespace(shape_expr=[Dim(d) for d in shape], dtype=dtype)

    q, k = desc((2, 8, 5, 64), "bf16"), desc((2, 2, 96, 64), "bf16")
    mask, prefix = desc((2, 5, 1), "i32"), desc((2,), "i32")
    aot = registered[("aot", trt_plugin.PLUGIN_ID)]
    name, ptx, launch, extra_args = aot(q, k, k, prefix, mask, 0.125, (q,), 0)
    assert name == b"tree_attention_fwd" and b".entry tree_attention_fwd" in ptx
    assert (launch.grid_x, launch.grid_y, launch.grid_z) == (4, 2, 1)  # 2 seqs x 2 kv heads; 4 x 5 rows / 16
    assert launch.block_x == 128 and launch.shared_mem > 0
    assert len(extra_args) == len(trt_plugin.SCALAR_ARGS)
    with pytest.raises(ValueError, match="static"):
        dynamic = desc((2, 8, 5, 64), "bf16")
        dynamic.shape_expr[3] = types.SimpleNamespace(is_constant=False)
        aot(dynamic, k, k, prefix, mask, 0.125, (q,), 0)


# ---------------------------------------------------------------------------------------------
# GPU (skipped without CUDA)
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_CASES = [dict(c, dtype=dt, name=f"{c['name']}-{dt}") for c in CPU_CASES for dt in ("bfloat16", "float32")] + [
    spec("llama8b-verify-gqa4", H=32, Hkv=8, n=8, D=128, S=2100, prefix=[2048, 700], mask="chain", dtype="bfloat16"),
    spec("llama1b-tree-64", H=32, Hkv=8, n=64, D=64, S=1200, prefix=[1000, 333], mask="forest", forest=(2, 31, 2),
         dtype="bfloat16", seed=3),
    spec("llama8b-tree-fp16-splits", H=32, Hkv=8, n=32, D=128, S=4200, prefix=[4096, 17], mask="tree",
         dtype="float16", seed=4, config=dict(block_m=128, block_n=64, num_splits=16, num_warps=8)),
]  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=[c["name"] for c in GPU_CASES])
def test_compiled_kernel_matches_reference(case):
    pytest.importorskip("triton")
    result = run_case(case, "cuda")
    assert result["finite"], result
    assert result["max_err"] <= TOLERANCE[case["dtype"]], result


@pytest.mark.gpu
@needs_cuda
def test_cuda_dispatch_uses_the_kernel(monkeypatch):
    pytest.importorskip("triton")
    import trtssd.kernels
    from trtssd.models import attention
    from trtssd.kernels import tree_attention_triton as kt

    calls = []
    real = kt.tree_attention_triton
    monkeypatch.setattr(kt, "tree_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, prefix_len, mask = case_tensors(GPU_CASES[-3], "cuda")
    rows = torch.tensor([2, 0], device="cuda")  # the same K/V as rows of a 3-row pool
    pool_k, pool_v = k.new_zeros(3, *k.shape[1:]), v.new_zeros(3, *v.shape[1:])
    pool_k[rows], pool_v[rows] = k, v
    trtssd.kernels.load_tree_attention_kernel.cache_clear()  # so the loader picks up the spy
    try:
        out = attention.tree_attention(q, k, v, prefix_len, mask)
        pooled = attention.tree_attention(q, pool_k, pool_v, prefix_len, mask, kv_rows=rows)
    finally:
        trtssd.kernels.load_tree_attention_kernel.cache_clear()
    ref = attention.tree_attention_reference(q, k, v, prefix_len, mask)
    assert len(calls) == 2, "tree_attention did not dispatch to the Triton kernel on CUDA"
    assert (out.float() - ref.float()).abs().max().item() <= TOLERANCE["bfloat16"]
    assert (pooled.float() - ref.float()).abs().max().item() <= TOLERANCE["bfloat16"]


@pytest.mark.gpu
@needs_cuda
def test_tensorrt_plugin_matches_reference():
    pytest.importorskip("tensorrt")
    pytest.importorskip("triton")
    from plugins.tree_attention.network import EngineShapes, build_tree_attention_engine, run_tree_attention_engine
    from trtssd.models.attention import tree_attention_reference
    from trtssd.kernels.packed_mask import pack_mask

    case = spec("trt", H=8, Hkv=2, n=7, D=64, S=96, prefix=[40, 80], mask="tree", dtype="bfloat16", seed=5)
    q, k, v, prefix_len, mask = case_tensors(case, "cuda")
    words = pack_mask(mask)
    shapes = EngineShapes(2, 8, 2, 7, 64, 96, words.shape[2])
    engine = build_tree_attention_engine(shapes, "bfloat16", scale=64**-0.5)
    out = torch.empty_like(q)
    io = dict(q=q, k=k, v=v, prefix_len=prefix_len.int(), mask_words=words, out=out)
    run_tree_attention_engine(engine, io)
    ref = tree_attention_reference(q, k, v, prefix_len, mask)
    assert (out.float() - ref.float()).abs().max().item() <= TOLERANCE["bfloat16"]


if __name__ == "__main__":
    # Interpreter child (see module docstring): JSON case specs in, JSON errors out.
    torch.set_num_threads(1)
    print(json.dumps([run_case(case, "cpu") for case in json.load(sys.stdin)]))
