"""Our int4 matmul against aten's (bf16 activations) on the default engine's draft, one thread:
each projection shape alone (weights cached), then all 120 projections of the 30 layers and the
head streamed once per pass (weights from memory, as in a forward). Alternates the two kernels.

    .venv/bin/python docs/bench/int4-matmul/projections.py
"""
import time

import torch

from trtssd.backends.loading import load_side
from trtssd.kernels.int4_matmul import int4_linear

torch.set_num_threads(1)
model = load_side("engines/smollm2-135m", "draft", max_seqs=1, max_seq_len=256).model
projections = [p for layer in model.layers for p in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)]
head = model.lm_head.int4


def ours(p, x):
    return int4_linear(x, p.kernel_weight)


def aten(p, x):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), p.packed, 32, p.scale_zeros)


def per_pass_ms(kernel, layers, rows, passes):
    xs = {p.in_features: torch.randn(rows, p.in_features) for p in layers}
    for p in layers:
        kernel(p, xs[p.in_features])
    start = time.perf_counter()
    for _ in range(passes):
        for p in layers:
            kernel(p, xs[p.in_features])
    return (time.perf_counter() - start) / passes * 1e3


print("one projection, cached (ms per call)")
for name, p in [("qkv", projections[0]), ("o", projections[1]), ("gate_up", projections[2]), ("down", projections[3]),
                ("head", head)]:
    for rows in (1, 4, 6):
        a, b = per_pass_ms(ours, [p], rows, 50), per_pass_ms(aten, [p], rows, 50)
        print(f"  {name:8s} {p.out_features}x{p.in_features} rows {rows}: ours {a:.3f}  aten {b:.3f}")
print("all 120 projections streamed (ms per pass), three alternations")
for rows in (1, 2, 4, 6):
    runs = [(per_pass_ms(ours, projections, rows, 10), per_pass_ms(aten, projections, rows, 10)) for _ in range(3)]
    print(f"  rows {rows}: ours " + " ".join(f"{a:.1f}" for a, _ in runs) + "   aten " + " ".join(f"{b:.1f}" for _, b in runs))
