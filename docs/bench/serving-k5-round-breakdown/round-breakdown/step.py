import time, torch, sys
torch.set_num_threads(1)
from trtssd.backends.loading import load_side
from trtssd.backends.base import chain_chunk
from trtssd.spec_decode.tree import append_chunk
from trtssd.models.engine_dir import *  # noqa
import glob
eng = sys.argv[1]
ex = load_side(eng, "draft", max_seqs=4, max_seq_len=2048)
ex.add_sequence(0)
ex.forward([chain_chunk(0, list(range(100, 200)), 0, last_logits_only=True)])
ex.commit(0, 100)
def step(i):
    return ex.forward([append_chunk(0, 100, [500 + i], i)])
for i in range(5): step(i)
N = 30
t0 = time.perf_counter(); c0 = time.thread_time()
for i in range(N): step(i % 8)
t1 = time.perf_counter(); c1 = time.thread_time()
print(f"executor.forward 1 row: wall {(t1-t0)/N*1e3:.2f} ms, cpu {(c1-c0)/N*1e3:.2f} ms")
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for i in range(N): step(i % 8)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
