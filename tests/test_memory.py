"""Memory stays flat over a long loop of calls (MPI tier, n = 1..5).

A training job issues a non-blocking collective per bucket, per step, for days: a call that
stays referenced after it completes (by a request, the watchdog's registry, the progress
engine, a pending list) keeps its buffers, and the loop ends in an out-of-memory crash. Two
checks per form of call:

- *released*: weak references to a completed call's input and output die once the caller
  drops them, whoever completed the call (``wait``, ``test``, the progress thread, a later
  call's drain), the watchdog on (its default);
- *flat*: the resident set grows by a bounded amount over a loop of calls after a warm-up.
"""
import gc
import weakref

import numpy as np
import pytest

import collectives as coll
from tests.mpiutil import assert_all, spans_nodes, world

ELEMENTS = 1 << 16  # 256 KiB of float32 per call
WARMUP, CALLS = 50, 600
GROWTH_MIB = 32  # bound on resident growth over CALLS calls (a leak of one call is 0.5 MiB)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _numpy_calls(n: int, rank: int) -> dict:
    """Each form of non-blocking call: a function of a fresh input, returning the request."""
    return {
        "iallreduce": lambda x: coll.iallreduce(x),
        "iallreduce in place": lambda x: coll.iallreduce(x, out=x),
        "ireduce_scatter": lambda x: coll.ireduce_scatter(x),
        "iallgather ragged": lambda x: coll.iallgather(x[: len(x) - rank]),
        "ibroadcast": lambda x: coll.ibroadcast(x),
        "ialltoall": lambda x: coll.ialltoall(x[: len(x) // n * n]),
        "igather": lambda x: coll.igather(x),
        "iscatter": lambda x: coll.iscatter(x[: len(x) // n * n]),
    }


CASES = ("iallreduce", "iallreduce in place", "ireduce_scatter", "iallgather ragged",
         "ibroadcast", "ialltoall", "igather", "iscatter")


# How a call completes: ``wait()``; polling ``test()``; or never waited on, its request dropped,
# for the progress thread to complete (without the thread a dropped request's schedule has
# nobody to advance it; the node's shared-memory calls are run by a later call instead:
# test_dropped_shm_call_released_by_the_next_call).
COMPLETIONS = (("wait", False), ("test", False), ("wait", True), ("dropped", True))


def _complete(req, how: str):
    if how == "wait":
        return req.wait()
    if how == "test":
        while not req.test():
            pass
        return req.wait()
    return None


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("completion, progress", COMPLETIONS,
                         ids=[f"{how}-{'thread' if t else 'caller'}" for how, t in COMPLETIONS])
def test_completed_call_releases_its_buffers(case, completion, progress, setting):
    setting("COLLECTIVES_PROGRESS_THREAD", progress)
    comm = world()
    start = _numpy_calls(comm.Get_size(), comm.Get_rank())[case]
    refs = []
    for _ in range(3):
        x = np.ones(ELEMENTS, np.float32)
        out = _complete(start(x), completion)
        refs.append(weakref.ref(x))
        if out is not None:
            refs.append(weakref.ref(out))
        del x, out
    # A later call's wait: the progress thread, if on, has finished with the earlier ones
    # (it runs them in order), and a later call has drained any left to the caller.
    coll.iallreduce(np.zeros(1, np.float32)).wait()
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert_all(alive == 0, f"{case} ({completion}, progress thread {progress}): {alive} of "
                           f"{len(refs)} buffers still referenced after completion")


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("registered", [False, True], ids=["shm", "registered"])
def test_dropped_shm_call_released_by_the_next_call(registered):
    """A call that moves only when a rank runs it (the node's shared-memory path), its request
    dropped: the next call on the communicator runs it, and then nothing keeps its buffers."""
    if spans_nodes():
        pytest.skip("the node's shared-memory path needs every rank on one node")
    refs = []
    for _ in range(5):
        x = coll.empty(ELEMENTS, np.float32) if registered else np.ones(ELEMENTS, np.float32)
        x[:] = 1
        coll.iallreduce(x, out=x, algorithm="onepass" if registered else "shm")
        refs.append(weakref.ref(x))
        del x
    coll.allreduce(np.zeros(1, np.float32))
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert_all(alive == 0, f"{alive} of {len(refs)} dropped calls' buffers still referenced")


def _loop(call, calls: int) -> float:
    for _ in range(calls):
        call()
    return _rss_mib()


def _flat(name: str, call) -> None:
    _loop(call, WARMUP)
    before = _rss_mib()
    grown = _loop(call, CALLS) - before
    assert_all(grown <= GROWTH_MIB, f"{name}: resident memory grew {grown:.0f} MiB over "
                                    f"{CALLS} calls of {ELEMENTS * 4 >> 10} KiB")


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES)
def test_memory_flat_numpy(case):
    comm = world()
    start = _numpy_calls(comm.Get_size(), comm.Get_rank())[case]
    _flat(case, lambda: start(np.ones(ELEMENTS, np.float32)).wait())


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_memory_flat_registered():
    x = coll.empty(ELEMENTS, np.float32)
    _flat("registered allreduce", lambda: coll.allreduce(x, out=x))
    _flat("registered iallreduce", lambda: coll.iallreduce(x, out=x).wait())


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_memory_flat_torch_dropin():
    torch = pytest.importorskip("torch")
    from collectives.torch import all_reduce
    _flat("all_reduce(async_op=True)",
          lambda: all_reduce(torch.ones(ELEMENTS), async_op=True).wait())


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_memory_flat_torch_backend(process_group):
    """torch's own async calls on the backend, as FSDP2 and torch's DDP issue every step."""
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    full = torch.empty(ELEMENTS * n)
    _flat("dist.all_reduce(async_op=True)",
          lambda: dist.all_reduce(torch.ones(ELEMENTS), async_op=True).wait())
    _flat("dist.all_gather_into_tensor(async_op=True)",
          lambda: dist.all_gather_into_tensor(full, torch.ones(ELEMENTS), async_op=True).wait())
    _flat("dist.reduce_scatter_tensor(async_op=True)",
          lambda: dist.reduce_scatter_tensor(torch.empty(ELEMENTS), torch.ones(ELEMENTS * n),
                                             async_op=True).wait())
