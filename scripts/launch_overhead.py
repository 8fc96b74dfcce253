"""Wall and CPU seconds of MLX evaluations in a plain process and in the ranks of `mlx.launch` (the micro test of the
benchmark notebook's "Sweeps over mlx.launch ranks"):

    python scripts/launch_overhead.py small|large
    mlx.launch --backend ring -n 2 -- python scripts/launch_overhead.py small|large
    NO_INIT=1 mlx.launch --backend ring -n 2 -- python scripts/launch_overhead.py small   # ranks without mx.distributed.init()

small: 3000 evaluations of one 256x256 matmul + tanh (latency-bound, like decode steps of a small model);
large: 200 evaluations of ten 1024x1024 matmuls (throughput-bound)."""
import os
import sys
import time

import mlx.core as mx

rank = int(os.environ.get("MLX_RANK", 0)) if os.environ.get("NO_INIT") else mx.distributed.init().rank()
small = (sys.argv[1] if len(sys.argv) > 1 else "small") == "small"
n, steps = (256, 3000) if small else (1024, 200)
x = mx.random.normal((n, n))
t, c = time.perf_counter(), time.process_time()
for _ in range(steps):
    y = x
    for _ in range(1 if small else 10): y = mx.tanh(y @ x * 0.01)
    mx.eval(y)
    if small: x = y
print(f"rank {rank}: {'small' if small else 'large'} wall {time.perf_counter() - t:.2f} s cpu {time.process_time() - c:.2f} s", flush=True)
