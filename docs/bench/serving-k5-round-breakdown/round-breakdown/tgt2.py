import time, torch, sys
import torch.nn.functional as F
torch.set_num_threads(1)
from trtssd.models import llama
from trtssd.backends.loading import load_side
from trtssd.backends.base import chain_chunk
from trtssd.spec_decode.tree import append_chunk
ex = load_side("engines/smollm2-135m", "target", max_seqs=4, max_seq_len=2048)
ex.add_sequence(0)
ex.forward([chain_chunk(0, list(range(100, 200)), 0, last_logits_only=True)])
ex.commit(0, 100)
def run(tag):
    for n in (1, 6):
        f = lambda: ex.forward([append_chunk(0, 100, list(range(500, 500 + n)), 0)])
        for i in range(2): f()
        N = 8; t0 = time.perf_counter()
        for i in range(N): out = f()
        print(tag, n, f"{(time.perf_counter()-t0)/N*1e3:.1f} ms", flush=True)
    return out
a = run("onednn")
orig = llama.Linear.forward
def mkl(self, x):
    if self.weight is not None and x.shape[0] <= 8:
        return F.linear(x, self.weight, self.bias)
    return orig(self, x)
llama.Linear.forward = mkl
b = run("mkl")
c = torch.stack([ex.forward([append_chunk(0, 100, list(range(500, 500 + j + 1)), 0)])[0][-1] for j in range(6)])
print("6-row mkl vs per-prefix-row max diff", (b[0] - c).abs().max().item())
