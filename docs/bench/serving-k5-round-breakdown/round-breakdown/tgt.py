import time, torch, sys
torch.set_num_threads(1)
from trtssd.backends.loading import load_side
from trtssd.backends.base import chain_chunk
from trtssd.spec_decode.tree import append_chunk
ex = load_side(sys.argv[1], "target", max_seqs=4, max_seq_len=2048)
ex.add_sequence(0)
ex.forward([chain_chunk(0, list(range(100, 200)), 0, last_logits_only=True)])
ex.commit(0, 100)
for n in (1, 2, 4, 6, 8):
    f = lambda: ex.forward([append_chunk(0, 100, list(range(500, 500 + n)), 0)])
    for i in range(3): f()
    N = 10
    t0 = time.perf_counter()
    for i in range(N): f()
    print(n, f"{(time.perf_counter()-t0)/N*1e3:.1f} ms", flush=True)
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for i in range(10): ex.forward([append_chunk(0, 100, list(range(500, 506)), 0)])
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(8)
