"""Benchmarks of the per-step update path, on the simulator (npusim).

* :mod:`~npugraph.bench.measured`: host time of npugraph's update against vllm-ascend's older
  loop, the API floor and the minimal validated update, measured on this machine;
* :mod:`~npugraph.bench.rivals`: the implementations the modeled timeline compares (npugraph,
  vllm-ascend's ``UpdatableGraph``, the older loop, torch_npu's ``NPUGraph.update``), each
  recording its device-API calls;
* :mod:`~npugraph.bench.modeled`: those recordings replayed on a model of the host and the
  device (``npugraph.bench.timeline``) over the serving shapes;
* :mod:`~npugraph.bench.sink`: the tiling-sink path, modeled;
* :mod:`~npugraph.bench.report`: ``npugraph bench``, printing and returning them all;
* :mod:`~npugraph.bench.plot`: ``npugraph bench --plot``, the modeled rows as a chart (matplotlib,
  imported when one is drawn).
"""

from npugraph.bench.measured import (
    bench_capture,
    bench_replay_vs_eager,
    bench_update,
    bench_validation,
    python_loop_ns,
    run_bench,
)
from npugraph.bench.modeled import SHAPES, ModeledShape, bench_timeline, engine_step, modeled_summary
from npugraph.bench.sink import bench_sink

__all__ = [
    "SHAPES",
    "ModeledShape",
    "bench_capture",
    "bench_replay_vs_eager",
    "bench_sink",
    "bench_timeline",
    "bench_update",
    "bench_validation",
    "engine_step",
    "modeled_summary",
    "python_loop_ns",
    "run_bench",
]
