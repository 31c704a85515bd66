import time, torch, random, sys
from npugraph import bench
from npugraph.replay import AttentionMetadata
import npugraph.replay.lens as L
import npugraph.replay.updater as U
torch.set_num_threads(1)
kern = sys.argv[1] if len(sys.argv) > 1 else "pa"
rt, stack, table, q = bench._setup(32, 8, kern, False)
up = rt.updater
rng = random.Random(0)
acc = {}
def wrap(obj, name):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc.setdefault(name, []).append(time.perf_counter() - t); return r
    setattr(obj, name, g)
wrap(L, "_check_block_ids"); wrap(L, "pad_lens"); wrap(L, "_host_ints"); wrap(U, "convert"); wrap(U, "_resolve")
for n in ("_prepare_checked", "_prepare_one", "_issue", "_issue_tasks", "_release_other", "_settle", "_order_update", "_flag", "_write"):
    wrap(U.ReplayUpdater, n)
tot=[]
for i in range(60):
    lens = torch.tensor([rng.randint(1, 2048) for _ in range(8)], dtype=torch.int32)
    m = {"default": AttentionMetadata(seq_lens=lens, block_table=table)}
    t=time.perf_counter(); up.update("main", 8, m); tot.append(time.perf_counter()-t)
    up.replay("main", 8); rt.device.npu.synchronize()
import statistics as s
print("total", round(s.median(tot)*1e6))
for k, v in acc.items(): print(k, round(s.median(v[5:])*1e6,1))
