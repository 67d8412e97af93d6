"""collectives.plan: the activation formulas against what autograd saves (one process, and tp 2-3
with and without sequence parallelism under MPI), in-flight micro-batches against the pipeline
simulator, model states against Megatron's bytes per parameter, the search's pruning against
pricing every plan, and the command line."""
import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from bench.tp import train_gpt_module  # noqa: E402

train_gpt = train_gpt_module()

from collectives import plan  # noqa: E402
from collectives.plan.record import Plan  # noqa: E402
from collectives.torch import checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(240)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize("b, s, h, a", [(2, 64, 96, 6), (3, 40, 48, 4), (1, 17, 24, 3)])
def test_layer_activations_are_what_autograd_saves(attention, policy, b, s, h, a):
    torch.manual_seed(0)
    model = train_gpt.GPT(264, h, a, 1, attention)
    if policy != "none":
        checkpoint.recompute(model, checkpoint.GPT_POLICIES[policy])
    x = torch.randn(b, s, h, requires_grad=True)
    saved, _ = checkpoint.saved_bytes(lambda: model.blocks[0](x))
    shape = plan.gpt(1, h, a, s, 264, attention=attention)
    assert plan.layer_activations(shape, b, 1, False, policy) == saved


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_wrappers_add_nothing_to_what_a_block_saves(zero):
    """A block wrapped for data parallelism (DDP, whose gradients are views of its buckets;
    ZeRO-1, whose parameters are views of its flat buffers) saves for backward what the
    plain block saves and ``layer_activations`` prices, on every rank."""
    from mpi4py import MPI

    from collectives.torch import DistributedDataParallel, ShardedDataParallel
    from mpiutil import assert_all
    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks or more")
    b, s, h, a = 2, 16, 48, 4
    torch.manual_seed(0)
    block = train_gpt.GPT(264, h, a, 1, "math").blocks[0]
    wrapped = DistributedDataParallel(block, comm=world) if zero == 0 else \
        ShardedDataParallel(block, stage=1, comm=world)
    x = torch.randn(b, s, h, requires_grad=True)
    saved, out = checkpoint.saved_bytes(lambda: wrapped(x))
    out.square().mean().backward()
    want = plan.layer_activations(plan.gpt(1, h, a, s, 264, attention="math"), b, 1, False,
                                  "none")
    found = world.allgather(saved)
    assert_all(saved == want, f"saved on each rank {found}, priced {want}")


@pytest.mark.mpi
@pytest.mark.parametrize("tp_size", [2, 3])
@pytest.mark.parametrize("sp", [False, True])
def test_layer_activations_under_tensor_parallelism(tp_size, sp):
    """A parallelized block's saved bytes on every rank of the tp group (its input: this rank's
    tokens under sequence parallelism) equal the formula at that tp."""
    from mpi4py import MPI

    from collectives.torch import tensor_parallel as tp
    from mpiutil import assert_all
    world = MPI.COMM_WORLD
    if world.Get_size() < tp_size:
        pytest.skip(f"needs {tp_size} ranks")
    sub = world.Split(0 if world.Get_rank() < tp_size else MPI.UNDEFINED, world.Get_rank())
    problems = []
    if sub != MPI.COMM_NULL:
        b, s, h, a = 2, 12, 24, 6
        for attention in ("sdpa", "math"):
            for policy in ("none", "selective", "full"):
                torch.manual_seed(0)
                model = train_gpt.GPT(264, h, a, 1, attention)
                tp.parallelize(model, sub, train_gpt.plan(model, sp, policy))
                x = torch.randn(b, s // tp_size if sp else s, h, requires_grad=True)
                saved, y = checkpoint.saved_bytes(lambda: model.blocks[0](x))
                y.sum().backward()   # the backward's collectives, on every rank alike
                want = plan.layer_activations(plan.gpt(1, h, a, s, 264, attention=attention),
                                              b, tp_size, sp, policy)
                if saved != want:
                    problems.append(f"{attention} {policy}: saved {saved}, formula {want}")
        sub.Free()
    assert_all(not problems, "; ".join(problems))


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1),
                                     ("interleaved", 2)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 3), (3, 6)])
def test_in_flight_is_the_simulators_peak(name, v, p, m):
    from collectives.torch import pipeline as pp
    try:
        sched = pp.schedule(name, p, m, v)
    except ValueError:
        pytest.skip("schedule not defined for these sizes")
    peak = pp.simulate(sched).peak
    for r in range(p):
        held = plan.in_flight(name, p, m, v, r)
        assert sum(k for _, k in held) == peak[r]
        assert all(s % p == r for s, _ in held)
    if name == "gpipe":
        assert peak == [m] * p
    if name == "1f1b":
        assert peak == [min(p - r, m) for r in range(p)]


def _world_schedule(world, name: str, m: int, v: int):
    """(schedule ``name`` over ``world``'s ranks, this rank, the stage count), or a skip."""
    from collectives.torch import pipeline as pp
    p = world.Get_size()
    if p < 2:
        pytest.skip("needs 2 ranks or more")
    try:
        sched = pp.schedule(name, p, m, v)
    except ValueError:
        pytest.skip("schedule not defined for these sizes")
    return sched, world.Get_rank(), p * v


@pytest.mark.mpi
@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1),
                                     ("interleaved", 2)])
def test_held_is_what_the_pipeline_runner_keeps(name, v, monkeypatch):
    """What ``pp.Pipeline`` keeps through a step, sampled after every action (what autograd
    saves, each storage once, through saved-tensor hooks; the stage outputs and the tensors it
    sends, through weak references), peaks at what ``plan.memory.held`` prices: its graphs
    times each stage's saved bytes plus its hidden states times one message's."""
    import weakref

    from mpi4py import MPI

    from collectives import p2p
    from collectives.plan.memory import held
    from collectives.torch import pipeline as pp
    from collectives.torch.pipeline import runner as runner_module
    from mpiutil import assert_all
    world = MPI.COMM_WORLD
    p, m, width, rows = world.Get_size(), 4, 16, 8
    sched, r, S = _world_schedule(world, name, m, v)
    torch.manual_seed(0)
    every = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                 torch.nn.Linear(width, width)) for _ in range(S)]
    mine = sched.local_stages(r)
    x, y = torch.randn(rows, width), torch.randn(rows, width)

    def loss(z, target):
        return (z - target).square().mean()

    # each stage's saved bytes for one micro-batch (the first stage's input is the batch's,
    # held outside the runner), and one message's
    graph = {}
    for s in mine:
        inp = torch.randn(rows // m, width, requires_grad=s > 0)
        saved, out = checkpoint.saved_bytes(lambda: every[s](inp))
        if s == 0:
            saved -= inp.nbytes
        if s == S - 1:
            more, _ = checkpoint.saved_bytes(lambda: loss(out, y[:rows // m]))
            saved += more
        graph[s] = saved
    message = rows // m * width * 4
    want = max(sum(k * graph[s] for s, k in graphs) + sent * message
               for graphs, sent in held(name, p, m, v, r))

    saved_now: weakref.WeakSet = weakref.WeakSet()
    messages: list = []
    peak = [0]

    class Saved:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def pack(t):
        box = Saved(t)
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            saved_now.add(box)
        return box

    def sample(*_):
        storages = {box.t.untyped_storage().data_ptr(): box.t.untyped_storage().nbytes()
                    for box in list(saved_now)}
        for ref in messages:
            t = ref()
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        storages.pop(x.untyped_storage().data_ptr(), None)
        peak[0] = max(peak[0], sum(storages.values()))

    def output(mod, args, out):
        if mod is not every[S - 1]:
            messages.append(weakref.ref(out))
        sample()

    for s in mine:
        every[s].register_forward_hook(output)
    send, backward = runner_module.Pipeline._send, runner_module.Pipeline._backward
    isend = p2p.isend

    def sends(comm, t, *args):    # the tensor the send keeps until it completes
        messages.append(weakref.ref(t))
        return isend(comm, t, *args)

    monkeypatch.setattr(p2p, "isend", sends)

    def sending(self, *args):
        send(self, *args)
        sample()

    def backward_then_sample(self, *args):
        backward(self, *args)
        sample()

    def loss_fn(z, target):
        out = loss(z, target)
        sample()
        return out

    runner = pp.Pipeline([every[s] for s in mine], comm=world, schedule=sched, loss_fn=loss_fn)
    runner._send = sending.__get__(runner)
    runner._backward = backward_then_sample.__get__(runner)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        runner.step(x, y)
    found = world.allgather((peak[0], want))
    assert_all(peak[0] == want, f"(held by the runner, priced by held()) on each rank: {found}")


@pytest.mark.mpi
@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1),
                                     ("interleaved", 2)])
def test_graded_is_when_a_plain_stage_holds_gradients(name, v):
    """A stage without data parallelism runs plain: after the optimizer's ``zero_grad`` its
    gradients are gone, and they come back at its first backward that accumulates them;
    after each compute action of the second step, the stages of this rank that hold any
    gradient are ``plan.memory.graded``'s."""
    from mpi4py import MPI

    from collectives.plan.memory import graded
    from collectives.torch import pipeline as pp
    from collectives.torch.pipeline import runner as runner_module
    from mpiutil import assert_all
    world = MPI.COMM_WORLD
    p, m, width, rows = world.Get_size(), 4, 16, 8
    sched, r, S = _world_schedule(world, name, m, v)
    torch.manual_seed(0)
    every = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
             for _ in range(S)]
    mine = sched.local_stages(r)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    runner = pp.Pipeline([every[s] for s in mine], comm=world, schedule=sched,
                         loss_fn=lambda z, t: (z - t).square().mean())
    opt = torch.optim.SGD([q for s in mine for q in every[s].parameters()], lr=0.1)
    seen = []
    compute = (runner_module.F, runner_module.B, runner_module.W)

    class Watched(list):
        def __iter__(self):
            for action in list.__iter__(self):
                yield action
                if action[0] in compute:
                    seen.append(tuple(s for s in mine
                                      if any(q.grad is not None
                                             for q in every[s].parameters())))

    runner._actions = Watched(runner._actions)
    runner.step(x, y)
    opt.step()
    opt.zero_grad()
    seen.clear()
    runner.step(x, y)
    want = list(graded(name, p, m, v, r))
    assert_all(seen == want, f"rank {r}: stages with gradients {seen}, graded {want}")


def test_a_plain_pipeline_stage_holds_its_gradients_from_its_first_backward():
    """GPipe's fullest moment, the end of the forwards, precedes every backward: a plain
    stage (no data parallelism) holds no gradient then, a data-parallel one (whose buckets
    keep them) all of its; 1F1B's first rank is fullest after a backward, with all of them."""
    from collectives.plan.memory import rank_memory
    shape = plan.gpt(4, 128, 4, 64, 264, attention="math")

    def grads(dp, schedule, r):
        q = Plan(dp, 4 // dp // 2, 2, False, schedule, 1, 4, 0, "none", 16 // dp // 4)
        return rank_memory(shape, q, r)[1]["grads"]

    assert grads(1, "gpipe", 1) == 0
    assert grads(1, "1f1b", 0) > 0
    assert grads(2, "gpipe", 1) > 0
    for schedule in ("gpipe", "1f1b"):
        total, terms = rank_memory(shape, Plan(1, 2, 2, False, schedule, 1, 4, 0, "none", 4),
                                   1)
        assert total == sum(v for k, v in terms.items() if k != "rank")


def test_host_slack_is_what_the_allocator_maps():
    """A tensor too large for the heap's free space is mapped on its own, in whole pages
    behind its headers: the mapped bytes (glibc's ``mallinfo2``) are its size plus
    ``host_slack``, on both sides of a page boundary."""
    import ctypes
    import ctypes.util

    from collectives.plan import measure
    from collectives.plan.memory import PAGE, host_slack

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2") or not measure.steady_allocator():
        pytest.skip("needs glibc's mallinfo2 and mallopt")
    libc.mallinfo2.restype = Info
    keep, found = [], []
    for x in (8 << 20, (8 << 20) + 4, (8 << 20) + PAGE - 136, (8 << 20) + PAGE - 132):
        before = libc.mallinfo2().hblkhd
        keep.append(torch.empty(x, dtype=torch.uint8))
        found.append((x, libc.mallinfo2().hblkhd - before - x, host_slack([x])))
    assert all(got == want for _, got, want in found), found
    assert host_slack([measure.MMAP_THRESHOLD - 4]) == 0


@pytest.mark.mpi
def test_node_windows_priced_are_the_ones_the_calls_map():
    """``scratch`` asks the selection table whether a call maps the node's shared window: for
    the calls the plans make (the tensor-parallel activations out of place, the loss's sums
    and the tied embedding's gradient in place), at sizes on both sides of the table's rules,
    the answer is whether the call on a fresh communicator maps one."""
    from mpi4py import MPI

    import collectives as coll
    from collectives.executor import cached_context
    from collectives.node.window import _Windows
    from collectives.plan.memory import _node_path
    from collectives.torch import all_reduce
    from mpiutil import assert_all
    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks or more")
    wrong, seen = [], set()
    for inplace in (False, True):
        for nbytes in (64, 4 << 10, 128 << 10, 512 << 10, 4 << 20):
            comm = world.Dup()
            x = torch.ones(nbytes // 4)
            if inplace:
                all_reduce(x, comm=comm)
            else:
                coll.allreduce(x, comm=comm)
            ctx = cached_context(comm)
            mapped = ctx is not None and _Windows in ctx.slots and \
                bool(ctx.slots[_Windows].by_chunk)
            priced = _node_path("allreduce", nbytes, world.Get_size(), inplace)
            seen.add(mapped)
            if mapped != priced:
                wrong.append(f"{nbytes} bytes, in place {inplace}: mapped {mapped}, "
                             f"priced {priced}")
            comm.Free()
    assert_all(not wrong and seen == {False, True}, "; ".join(wrong) or f"mapped: {seen}")


def test_model_states_are_megatrons_bytes_per_parameter():
    """Mixed precision without activations' share: 18 bytes a parameter without ZeRO, 6 + 12/dp
    with the optimizer sharded (Megatron's distributed optimizer), 4 + 2/dp + ... further."""
    from collectives.plan.memory import _states
    shape = plan.gpt(8, 256, 8, 128, 1024, precision="mixed", tied=False)
    n = shape.params()
    for zero, dp, per in [(0, 4, 18), (1, 4, 6 + 12 / 4), (1, 8, 6 + 12 / 8)]:
        q = Plan(dp, 1, 1, False, "1f1b", 1, 1, zero, "none", 1)
        states = _states(shape, q, shape.layers, True, True)
        total = states["params"] + states["grads"] + states["optimizer"]
        assert abs(total - per * n) <= 4 * 3, (zero, dp, total, per * n)


def _search(top, budget=None):
    shape = plan.gpt(8, 64, 4, 32, 256, attention="math")
    return plan.search(shape, 8, 16, budget, ranks_per_node=4,
                       network=plan.Network(ranks_per_node=4), compute=plan.FlopRate(1e9),
                       top=top)


def test_pruned_search_is_the_head_of_every_plan_priced():
    every = _search(None)
    assert len(every) == len(list(plan.candidates(plan.gpt(8, 64, 4, 32, 256,
                                                           attention="math"), 8, 16, 4)))
    times = [q.step_time for q in every]
    assert times == sorted(times)
    shape, net = plan.gpt(8, 64, 4, 32, 256, attention="math"), plan.Network(ranks_per_node=4)
    for q in every:   # the bound the pruning relies on holds for every plan
        assert plan.lower_bound(shape, q, net, plan.FlopRate(1e9)) <= q.step_time * (1 + 1e-9)
    pruned = _search(7)
    assert [(q.name(), q.step_time) for q in pruned] == \
        [(q.name(), q.step_time) for q in every[:7]]


def test_every_plan_listed_fits_the_budget():
    every = _search(None)
    budget = sorted(q.memory for q in every)[len(every) // 3]
    fitting = _search(None, budget)
    assert fitting and all(q.memory <= budget for q in fitting)
    assert len(fitting) == sum(q.memory <= budget for q in every)
    # recompute trades time for memory: full keeps no more than none for the same split (less
    # wherever the blocks' activations, not the head or the optimizer, make the peak)
    same = {}
    for q in every:
        same.setdefault((q.dp, q.tp, q.pp, q.sequence_parallel, q.schedule, q.virtual,
                         q.microbatches, q.zero), {})[q.recompute] = q
    for group in same.values():
        assert group["full"].memory <= group["selective"].memory <= group["none"].memory
        assert group["full"].step_time >= group["none"].step_time
    assert any(g["full"].memory < g["selective"].memory < g["none"].memory
               for g in same.values())


def test_parse_bytes():
    assert plan.parse_bytes("80GB") == 80 << 30
    assert plan.parse_bytes("512M") == 512 << 20
    assert plan.parse_bytes("1.5GiB") == 3 << 29
    assert plan.parse_bytes(3000000) == 3000000
    with pytest.raises(ValueError, match="expected bytes"):
        plan.parse_bytes("lots")


def test_command_line_json_and_table():
    cmd = [sys.executable, "-m", "collectives.plan", "--layers", "8", "--dim", "64", "--heads",
           "4", "--seq", "32", "--vocab", "256", "--ranks", "8", "--ranks-per-node", "4",
           "--global-batch", "16", "--flops", "1e9", "--top", "5"]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    plans = json.loads(out)
    assert len(plans) == 5 and all(p["dp"] * p["tp"] * p["pp"] == 8 for p in plans)
    assert [p["step_time"] for p in plans] == sorted(p["step_time"] for p in plans)
    text = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "| 1 | " in text and "planned in" in text
    tight = subprocess.run(cmd + ["--memory-per-rank", "1K"], capture_output=True, text=True,
                           cwd=ROOT)
    assert tight.returncode == 1 and "no plan fits" in tight.stdout


@pytest.mark.timeout(600)
def test_plan_auto_fits_a_budget_plain_data_parallelism_exceeds():
    """``mpiexec -n 4 examples/train_gpt.py --plan auto --memory-per-rank B`` with B below what
    plain data parallelism (dp 4, DDP, no recompute) is predicted to hold: the plan chosen is
    predicted to fit, its measured peak is under B, and its first loss is one process's within
    float32 rounding (after that, AdamW's steps bound nothing tighter than their size)."""
    import rounding
    if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("mpiexec not found beside the interpreter")
    flags = ["--dim", "128", "--heads", "4", "--layers", "4", "--seq", "64", "--batch", "16",
             "--attention", "math", "--steps", "3"]
    shape = plan.gpt(4, 128, 4, 64, 264, attention="math")
    plain = Plan(4, 1, 1, False, "1f1b", 1, 1, 0, "none", 4)
    budget = int(0.85 * plan.memory(shape, plain, 4)[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(PYTHONUNBUFFERED="1", MPIEXEC_TIMEOUT="500")
    out = {}
    for n, extra in ((1, []), (4, ["--plan", "auto", "--memory-per-rank", str(budget)])):
        done = subprocess.run([mpiexec, "-n", str(n), sys.executable,
                               os.path.join(ROOT, "examples", "train_gpt.py")] + flags + extra,
                              capture_output=True, text=True, timeout=540, env=env, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        out[n] = json.loads(done.stdout.strip().splitlines()[-1])
    one, auto = out[1], out[4]
    assert auto["plan"] != plain.name()
    assert auto["predicted_peak_bytes"] <= budget
    assert auto["peak_bytes"] <= budget, (auto["peak_bytes"], budget, auto["plan"])
    # the longest chain of sums in the GPT, forward (as test_tensor_parallel counts it)
    terms = 2 * (4 * (8 * 128 + 128 // 4 + 2 * 64) + 2 * 128 + 264) + 16 * 64 + 4
    # cross-entropy's terms: the log-sum-exp over the vocabulary (at most log V above the
    # largest logit, and a fresh model's logits are far below 1) and the target's logit
    scale = abs(one["losses"][0]) + math.log(264) + 1.0
    assert abs(auto["losses"][0] - one["losses"][0]) <= rounding.agree(terms, scale), \
        (auto["losses"], one["losses"])


@pytest.mark.timeout(600)
def test_bench_plan_measures_every_plan_it_predicts():
    """``python -m bench plan`` at 2 ranks on a tiny GPT: a row per plan, each with a measured
    peak and step, and the recompute table (in-process tier: it launches its own jobs)."""
    if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    out = os.path.join(ROOT, ".pytest-bench-plan.json")
    try:
        done = subprocess.run([sys.executable, "-m", "bench", "plan", "--ranks", "2", "--dim",
                               "32", "--heads", "2", "--layers", "2", "--seq", "16", "--batch",
                               "4", "--microbatches", "2", "--steps", "2", "--rounds", "1",
                               "--limit", "4", "--batch-plans", "2", "--json", out],
                              capture_output=True, text=True, timeout=560, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        with open(out) as f:
            result = json.load(f)
    finally:
        if os.path.exists(out):
            os.remove(out)
    rows = result["rows"]
    assert len(rows) == 4 and len({r["plan"] for r in rows}) == 4
    assert all(r["measured_bytes"] > 0 and r["measured_s"] > 0 for r in rows)
    # ranked by the planner's prediction; each round's own prediction beside its measurement
    assert [r["planned_s"] for r in rows] == sorted(r["planned_s"] for r in rows)
    assert all(len(r["predicted_s_rounds"]) == len(r["measured_s_rounds"]) == 1 and
               r["predicted_s"] > 0 for r in rows)
    saved = {k: v[0] for k, v in result["recompute"].items()}
    assert saved["full"] == 2 * 16 * 32 * 4   # the block's input: b s h floats
    assert saved["full"] < saved["selective"] < saved["none"]
    assert "| plan | predicted MiB |" in done.stdout


def test_a_pipeline_prices_its_tied_pair():
    """A pipeline's first and last stage sum the tied embedding's gradient: one allreduce of
    the tp rank's vocabulary shard over 2 ranks of stride dp tp (pp - 1), in the step and in
    its bytes; nothing without a pipeline or with an untied head."""
    shape = plan.gpt(4, 64, 4, 32, 256, attention="math")
    net, rate = plan.Network(ranks_per_node=8), plan.FlopRate(1e9)
    q = Plan(2, 2, 2, False, "1f1b", 1, 4, 0, "none", 1)
    total, _, sent, terms = plan.step_time(shape, q, net, rate)
    secs, nbytes = net.collective("allreduce", 4 * 256 * 64 // 2, 2, 2 * 2)
    assert terms["tied"] == secs > 0
    assert total == pytest.approx(sum(terms.values()))
    untied = plan.gpt(4, 64, 4, 32, 256, attention="math", tied=False)
    _, _, untied_sent, untied_terms = plan.step_time(untied, q, net, rate)
    assert untied_terms["tied"] == 0.0
    assert abs(sent["node"] - untied_sent["node"] - nbytes) <= 1
    flat = Plan(4, 2, 1, False, "1f1b", 1, 1, 0, "none", 4)
    assert plan.step_time(shape, flat, net, rate)[3]["tied"] == 0.0


def test_bench_probe_prices_what_it_measured_and_the_model_the_rest():
    """bench plan's network: the collectives and messages it measured in place answer from its
    tables, the rest from the cost model; what the time model asks of a network (collectives
    over more than one rank, messages with the first plan that sent each) is what the probe
    measures."""
    from bench.plan import _Asked, _Probed
    shape = plan.gpt(4, 64, 4, 32, 256, attention="math")
    net, rate = plan.Network(ranks_per_node=8), plan.FlopRate(1e9)
    q = Plan(2, 1, 2, False, "1f1b", 1, 4, 0, "none", 1)
    asked = _Asked(net)
    asked.plan = q
    assert plan.step_time(shape, q, asked, rate) == plan.step_time(shape, q, net, rate)
    msg = 4 * 1 * 32 * 64
    assert asked.messages == {(msg, 2, 2): q}
    kinds = {(k, n, stride) for k, _, n, stride in asked.collectives}
    assert kinds == {("allreduce", 2, 1), ("allreduce", 2, 2)}   # DDP over dp, the tied pair
    probe = _Probed(net, {key: 1.0 for key in asked.collectives}, {(msg, 2, 2): 0.5})
    assert probe.message(msg, 2, 2) == 0.5
    assert probe.message(msg + 4, 2, 2) == net.message(msg + 4, 2, 2)
    terms = plan.step_time(shape, q, probe, rate)[3]
    assert terms["dp_exposed"] == 1.0 and terms["tied"] == 1.0
    assert probe.collective("allreduce", 12, 2, 1) == net.collective("allreduce", 12, 2, 1)


@pytest.mark.mpi
def test_bench_probe_measures_on_the_plans_own_axes():
    """bench plan's probe groups ranks as the plan's mesh does (every axis, every rank at
    once), and a message and the data-parallel collectives are measured on them: seconds,
    the same on every rank of a pipeline."""
    from mpi4py import MPI

    from bench.plan import _axis, _collectives, _messages
    from collectives import Mesh
    world = MPI.COMM_WORLD
    n = world.Get_size()
    if n != 4:
        pytest.skip("a 2 x 2 mesh: 4 ranks")
    groups: dict = {}
    mesh = Mesh((2, 2, 1), ("pp", "dp", "tp"), comm=world)
    try:
        for name, size, stride in (("pp", 2, 2), ("dp", 2, 1), ("tp", 1, 1)):
            ours = _axis(world, groups, size, stride)
            assert ours.Get_size() == mesh.size(name)
            assert ours.Get_rank() == mesh.coord(name)
            members = ours.allgather(world.Get_rank())
            assert members == mesh.comm(name).allgather(world.Get_rank())
        table = _collectives(world, groups, [("allreduce", 4096, 2, 1),
                                             ("allgather", 4096, 2, 2)], repeats=2)
        assert set(table) == {("allreduce", 4096, 2, 1), ("allgather", 4096, 2, 2)}
        assert all(0 < secs < 5 for secs in table.values())
        secs = _messages(world, groups, 4096, 2, 2, 1e-3, repeats=2)
        assert 0 <= secs < 5
        assert len(set(_axis(world, groups, 2, 2).allgather(secs))) == 1
    finally:
        for comm in groups.values():
            comm.Free()
        mesh.free()


def test_bench_probe_rounds_give_each_figure_its_median():
    """bench plan's probe in rounds: per question, the median of the rounds' answers."""
    from bench.plan import _Median

    class Fixed:
        def __init__(self, k):
            self.k = k

        def layer(self, model, b, tp, sp, recompute):
            return self.k, 10 * self.k

        def head(self, model, b, tp, sp):
            return 2 * self.k, 3 * self.k

        def optimizer(self, params):
            return params * self.k

    both = _Median([Fixed(1.0), Fixed(5.0), Fixed(2.0)])
    assert both.layer(None, 1, 1, False, "none") == (2.0, 20.0)
    assert both.head(None, 1, 1, False) == (4.0, 6.0)
    assert both.optimizer(3) == 6.0


def test_zero_bubble_prices_the_split_backward_the_runner_runs():
    """Zero bubble's B (the stage input's gradient alone) is half a stage's backward and its W
    a whole one: autograd reaches the weights through every later layer's input gradient
    again (``torch.autograd.backward(out, g, inputs=params)`` in the runner)."""
    from collectives.plan.timing import _stages
    shape = plan.gpt(4, 64, 4, 32, 256, attention="math")
    net, rate = plan.Network(ranks_per_node=8), plan.FlopRate(1e9)
    one = _stages(shape, Plan(1, 1, 2, False, "1f1b", 1, 4, 0, "none", 1), net, rate)
    zb = _stages(shape, Plan(1, 1, 2, False, "zero_bubble", 1, 4, 0, "none", 1), net, rate)
    assert zb[0] == one[0]
    assert zb[1] == pytest.approx([b / 2 for b in one[1]])
    assert zb[2] == pytest.approx(one[1]) and one[2] == [0.0, 0.0]
