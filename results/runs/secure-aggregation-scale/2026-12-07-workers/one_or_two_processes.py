import sys, time
import numpy as np
from fedsd.secure.distributed_step import secure_round, run_roster
from fedsd.secure.client_groups import Workers
from fedsd.secure.ring import graph_parameters
if __name__ == "__main__":
    n, d = int(sys.argv[1]), int(sys.argv[2])
    g = graph_parameters(n, 0, 10, 0.05)
    rng = np.random.default_rng(0)
    xs = {k: rng.integers(0, 2 ** 40, d, dtype=np.uint64) for k in range(n)}
    truth = sum(xs.values())
    identities, _ = run_roster(range(n))
    w = Workers(2)
    w.start()
    for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 4):
        for workers in (None, w):
            t = time.perf_counter()
            total, cost = secure_round(f"b-{r}".encode(), {k: (lambda v=v: v) for k, v in xs.items()}, d, min_cohort=10,
                                       degree=g.k, identities=identities, workers=workers)
            assert np.array_equal(total, truth)
            print(r, "workers" if workers else "one", round(cost["protocol_seconds"], 2), round(time.perf_counter() - t, 2), flush=True)
    w.close()
