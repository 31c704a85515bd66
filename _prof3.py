import time, torch, random, sys, cProfile, pstats
from npugraph import bench
from npugraph.replay import AttentionMetadata
torch.set_num_threads(1)
rt, stack, table, q = bench._setup(32, 8, "pa", False)
up = rt.updater
rng = random.Random(0)
# replace the kernel loop by nothing to see the rest
up._issue_tasks = lambda us, plan, state, host: 0
pr = cProfile.Profile()
for i in range(200):
    lens = torch.tensor([rng.randint(1, 2048) for _ in range(8)], dtype=torch.int32)
    m = {"default": AttentionMetadata(seq_lens=lens, block_table=table)}
    pr.enable(); up.update("main", 8, m); pr.disable()
    rt.device.npu.synchronize()
    rt.updater._flagged = [] if hasattr(rt.updater, "_flagged") else None
st = pstats.Stats(pr); st.sort_stats("cumtime").print_stats(40)
