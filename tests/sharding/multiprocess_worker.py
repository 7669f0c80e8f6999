"""One process of a multi-process run: ``python multiprocess_worker.py ID COUNT HOST:PORT OUT``.

Started by test_multiprocess.py with 4 CPU devices per process. It joins
the others through ``jax.distributed.initialize``, runs the sharded
TransformerLayer train step on the global mesh (the ``dp`` axis spans the
processes, as it spans nodes on a cluster) and writes the gathered results
to ``OUT/result-ID.pkl``.
"""

import pathlib
import pickle
import sys

import jax

LAYOUT = "dp2_fsdp2_tp2"


def main(process_id: int, count: int, coordinator: str, out: str) -> None:
    # Gloo carries CPU collectives between processes (JAX 0.10's default; set
    # here so that the run does not depend on it).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes=count, process_id=process_id, initialization_timeout=60
    )
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import numpy as np
    import sharded_layer as sl
    from jax.experimental import multihost_utils

    import fp8jax.sharding as fs

    assert jax.device_count() == 8 and jax.local_device_count() == 8 // count
    sizes, config = sl.LAYOUTS[LAYOUT]
    mesh = fs.make_mesh(**sizes, config=config)
    state, losses = sl.run(sl.model(), sl.STEPS, mesh, config)
    # Every device of this process holds the same FP8 state ...
    for leaf in jax.tree.leaves(state.fp8_state):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards), "FP8 state differs on devices"
    host = multihost_utils.process_allgather(state, tiled=True)
    with open(pathlib.Path(out) / f"result-{process_id}.pkl", "wb") as f:
        pickle.dump({"state": host, "losses": np.asarray(losses)}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
