"""GPU allreduce benchmark on cupy buffers: ours vs the MPI library's own, staged vs direct.

    mpiexec -n 2 python3 tests/gpu/bench_gpu.py [--sizes 4K,64K,1M,16M,64M,256M] [--iters 10]
                                                [--out DIR]

Variants (each call returns with the result complete on the GPU):

- ``ring/staged``    collectives' ring allreduce, device memory staged through pinned host
                     blocks segment by segment (``COLLECTIVES_CUDA_AWARE=0``)
- ``auto/staged``    what ``algorithm="auto"`` picks, staged
- ``native/staged``  the MPI library's ``MPI_Allreduce`` on pinned host copies of the whole
                     buffer (what ``algorithm="native"`` does with a library that is not aware)
- ``ring/direct``    device views straight to MPI (only where the library is CUDA-aware)
- ``native/device``  ``MPI_Allreduce`` on the device buffers (only where CUDA-aware)
- ``native/host``    ``MPI_Allreduce`` on numpy host buffers: no GPU at all, the floor that
                     staging adds its copies to

Time is the median over iterations of the slowest rank's time; busbw = algbw x 2(n-1)/n as in
nccl-tests. ``#wrong`` counts result elements that differ from the closed form. Ranks may share
one GPU (rank r uses device r % count). Rank 0 prints the table and writes bench_gpu.txt and
bench_gpu.json into ``--out``.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

__all__ = ["main"]

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return str(nbytes)


def measure(fn, iters: int, comm, MPI) -> float:
    """Median of the slowest rank's time of ``fn()`` over ``iters`` runs (after 2 warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M", help="bytes per rank")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)

    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        import cupy
        ndev = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        if rank == 0:
            print(f"bench_gpu: needs cupy and a CUDA device ({exc!r})", file=sys.stderr)
        return 2
    cupy.cuda.Device(rank % ndev).use()
    from collectives import api as coll
    from collectives import config, cuda

    config.set("COLLECTIVES_CUDA_AWARE", None)
    aware, how = cuda.awareness()  # what the library says; each variant then sets the override
    variants = ["ring/staged", "auto/staged", "native/staged"]
    if aware:
        variants += ["ring/direct", "native/device"]
    variants.append("native/host")

    rows = []
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        count = max(1, nbytes // 4)
        nbytes = count * 4
        base = (np.arange(count) % 7).astype(np.float32)
        xh = base + rank
        want = size * base + size * (size - 1) / 2
        x = cupy.asarray(xh)
        y = cupy.empty_like(x)
        yh = np.empty_like(xh)
        iters = max(3, min(args.iters, (256 << 20) // nbytes))
        for variant in variants:
            name, how_ = variant.split("/")
            config.set("COLLECTIVES_CUDA_AWARE", how_ in ("direct", "device"))
            if how_ == "host":
                def fn():
                    comm.Allreduce(xh, yh)
            elif how_ == "device":
                def fn():
                    cupy.cuda.get_current_stream().synchronize()
                    comm.Allreduce(x, y)
            else:
                def fn(name=name):
                    coll.allreduce(x, out=y, algorithm=name)
            y.fill(-1)
            yh.fill(-1)
            t = measure(fn, iters, comm, MPI)
            got = yh if how_ == "host" else cupy.asnumpy(y)
            wrong = comm.allreduce(int((got != want).sum()), op=MPI.SUM)
            algbw = nbytes / t / 1e9
            rows.append({"bytes": nbytes, "count": count, "variant": variant,
                         "time_us": t * 1e6, "algbw": algbw,
                         "busbw": algbw * 2 * (size - 1) / size, "wrong": wrong,
                         "iters": iters})
        config.set("COLLECTIVES_CUDA_AWARE", False)
    if rank == 0:
        info = {"ranks": size, "gpus": ndev, "dtype": "float32", "op": "sum",
                "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"],
                "mpi": MPI.Get_library_version().strip().splitlines()[0],
                "cuda_aware": aware, "how": how,
                "segment_bytes": config.get("COLLECTIVES_SEGMENT_BYTES")}
        if isinstance(info["gpu"], bytes):
            info["gpu"] = info["gpu"].decode()
        text = table(rows, info)
        print(text)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gpu.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0


def table(rows, info) -> str:
    """The rows as text: one line per size and variant, with the ratio to native/staged."""
    ref = {r["bytes"]: r["time_us"] for r in rows if r["variant"] == "native/staged"}
    lines = [f"# collectives GPU allreduce: {info['ranks']} ranks on {info['gpus']} GPU(s) "
             f"({info['gpu']}), {info['dtype']} {info['op']}, segment "
             f"{human(info['segment_bytes'])}B",
             f"# MPI: {info['mpi']}; CUDA-aware: {info['cuda_aware']} ({info['how']})",
             f"# {'size':>6} {'count':>10}  {'variant':<14} {'time(us)':>10} "
             f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'x native/staged':>15}"]
    for r in rows:
        ratio = ref.get(r["bytes"], 0) / r["time_us"] if r["time_us"] else 0
        lines.append(f"  {human(r['bytes']):>6} {r['count']:>10}  {r['variant']:<14} "
                     f"{r['time_us']:>10.1f} {r['algbw']:>11.2f} {r['busbw']:>11.2f} "
                     f"{r['wrong']:>6} {ratio:>15.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
