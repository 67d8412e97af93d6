"""collectives.torch.checkpoint: recompute (full blocks, the attention core) gives the losses and
gradients of the same run without it, bitwise (the recompute runs the same kernels on the same
inputs), in one process, with tensor parallelism 2-3 (with and without sequence parallelism)
under DDP and ZeRO 1-2, ZeRO-3 (a recomputed layer gathered again), and every pipeline
schedule; what autograd saves for a block drops to the block's input under full recompute."""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from bench.tp import train_gpt_module  # noqa: E402

train_gpt = train_gpt_module()

from collectives.torch import checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(240)

TINY = ["--vocab", "264", "--dim", "24", "--heads", "6", "--layers", "2", "--seq", "12",
        "--batch", "4", "--steps", "3", "--lr", "0.05", "--corpus-bytes", "65536"]
POLICIES = ("selective", "full")


def _args(*extra):
    return train_gpt.parser().parse_args(TINY + list(extra))


def _run(args, mesh=None, text=None):
    """``args.steps`` SGD steps of ``train_gpt.build``'s model: (losses, per step every
    parameter's gradient as a dict of tensors)."""
    text = train_gpt.corpus(args.corpus_bytes) if text is None else text
    model, inner, _, loss_fn = train_gpt.build(args, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    dp = 1 if mesh is None else mesh.size("dp")
    me = 0 if mesh is None else mesh.coord("dp")
    rows = args.batch // dp
    losses, grads = [], []
    for step in range(args.steps):
        x, y = train_gpt.batch(text, step, args.batch, args.seq, args.seed)
        loss = loss_fn(model(x[me * rows:(me + 1) * rows]), y[me * rows:(me + 1) * rows])
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses, grads


def _differences(a, b) -> list[str]:
    (la, ga), (lb, gb) = a, b
    out = [f"loss of step {i}: {x.item()!r} != {y.item()!r}"
           for i, (x, y) in enumerate(zip(la, lb)) if not torch.equal(x, y)]
    for i, (x, y) in enumerate(zip(ga, gb)):
        if x.keys() != y.keys():
            out.append(f"step {i}: gradients of {sorted(x)} != {sorted(y)}")
        out += [f"step {i}: {n} differs by {(x[n] - y[n]).abs().max().item():.3g}"
                for n in x if n in y and not torch.equal(x[n], y[n])]
    return out


# -- one process --------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_equals_none_in_one_process(policy, attention):
    text = train_gpt.corpus(65536)
    base = _run(_args("--attention", attention), text=text)
    ours = _run(_args("--attention", attention, "--recompute", policy), text=text)
    assert _differences(base, ours) == []


def _block(attention, b=2, s=16, h=24, a=6):
    torch.manual_seed(0)
    model = train_gpt.GPT(264, h, a, 1, attention)
    x = torch.randn(b, s, h, requires_grad=True)
    return model, x


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_full_recompute_keeps_the_blocks_input_only(attention):
    model, x = _block(attention)
    plain, _ = checkpoint.saved_bytes(lambda: model.blocks[0](x))
    checkpoint.recompute(model, checkpoint.GPT_POLICIES["full"])
    full, y = checkpoint.saved_bytes(lambda: model.blocks[0](x))
    assert full == x.numel() * x.element_size()
    assert plain > 10 * full
    y.sum().backward()   # the recompute runs: the graph is whole
    assert x.grad is not None and all(p.grad is not None for p in model.blocks[0].parameters())


def test_selective_recompute_drops_the_scores():
    """The written-out core keeps softmax(q k^T) (b a s^2 floats) and its causal mask (s^2
    bools); recomputing the core keeps neither, and nothing else changes."""
    b, s, a = 2, 16, 6
    model, x = _block("math", b=b, s=s, a=a)
    plain, _ = checkpoint.saved_bytes(lambda: model.blocks[0](x))
    checkpoint.recompute(model, checkpoint.GPT_POLICIES["selective"])
    assert checkpoint.recomputed(model) == ["blocks.0.attn.core"]
    sel, _ = checkpoint.saved_bytes(lambda: model.blocks[0](x))
    assert plain - sel == b * a * s * s * 4 + s * s


def test_recompute_names_and_errors():
    model, x = _block("sdpa")
    with pytest.raises(ValueError, match=r"recompute patterns \['blocks.\*.nothing'\] name no "
                                         r"module of the GPT"):
        checkpoint.recompute(model, ["blocks.*", "blocks.*.nothing"])
    assert checkpoint.recompute(model, "blocks.*") == ["blocks.0"]
    checkpoint.recompute(model, "blocks.*")        # marking twice wraps once
    assert checkpoint.recomputed(model) == ["blocks.0"]
    assert "blocks.0.norm1.weight" in model.state_dict()   # names untouched
    with torch.no_grad():                          # no graph: a plain forward
        n, _ = checkpoint.saved_bytes(lambda: model.blocks[0](x))
    assert n == 0
    assert not checkpoint.recomputing()


def test_a_dropped_recomputed_model_goes_at_once():
    """Marking holds no cycle: a recomputed model that nobody references any more is freed
    when its last reference goes, with the cyclic collector off (a pipeline rank drops the
    stages it does not train right after cutting the model)."""
    import gc
    import weakref
    model = train_gpt.GPT(264, 32, 2, 2, "math")
    checkpoint.recompute(model, checkpoint.GPT_POLICIES["full"])
    checkpoint.recompute(model, checkpoint.GPT_POLICIES["selective"])
    model(torch.randint(0, 264, (2, 8))).sum().backward()
    refs = [weakref.ref(p) for p in model.parameters()]
    gc.collect()
    gc.disable()
    try:
        del model
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive == 0


def test_parallelize_takes_recompute_in_its_plan():
    from mpi4py import MPI

    from collectives.torch import tensor_parallel as tp
    model, _ = _block("sdpa")
    tp.parallelize(model, MPI.COMM_SELF, train_gpt.plan(model, False, "selective"))
    assert checkpoint.recomputed(model) == ["blocks.0.attn.core"]


# -- MPI: tensor x data parallelism -------------------------------------------------------------

def _first(n):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() < n:
        pytest.skip(f"needs {n} ranks")
    sub = world.Split(0 if world.Get_rank() < n else MPI.UNDEFINED, world.Get_rank())
    return None if sub == MPI.COMM_NULL else sub


CASES = [(1, 2, False, 0), (2, 1, False, 0), (2, 1, True, 0), (3, 1, False, 0),
         (3, 1, True, 0), (2, 2, True, 1), (2, 2, False, 2), (1, 3, False, 2)]


@pytest.mark.mpi
@pytest.mark.parametrize("tp_size, dp, sp, zero", CASES,
                         ids=[f"tp{t}-dp{d}{'-sp' if s else ''}-zero{z}" for t, d, s, z in CASES])
def test_recompute_equals_none_with_tensor_and_data_parallelism(tp_size, dp, sp, zero):
    from collectives import Mesh
    from mpiutil import assert_all
    sub = _first(tp_size * dp)
    problems = []
    if sub is not None:
        mesh = Mesh((dp, tp_size), ("dp", "tp"), comm=sub)
        text = train_gpt.corpus(65536)
        flags = ["--attention", "math", "--zero", str(zero)] + (["--sequence-parallel"] if sp
                                                                 else [])
        base = _run(_args(*flags), mesh, text)
        for policy in POLICIES:
            ours = _run(_args(*flags, "--recompute", policy), mesh, text)
            problems += [f"{policy}: {d}" for d in _differences(base, ours)]
        sub.Free()
    assert_all(not problems, "; ".join(problems[:6]))


def _untied_gpt(attention="math"):
    """The example's GPT with its own head weight (ZeRO-3 gathers one layer's weights at a
    time, and a weight shared by two layers is freed under the other)."""
    torch.manual_seed(0)
    model = train_gpt.GPT(24, 16, 4, 2, attention)
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    return model


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_recompute_under_zero3_regathers(ranks):
    """ShardedDataParallel stage 3 frees a layer after its forward; the recompute gathers it
    again and keeps it to its backward: losses and gradients (the shards') equal no recompute,
    and a step all-gathers each layer twice as without recompute (once for the forward, once
    for the recompute and backward together), not three times."""
    from collectives.torch import ShardedDataParallel
    from mpiutil import assert_all
    sub = _first(ranks)
    problems = []
    if sub is not None:
        text = torch.arange(600) % 24

        def run(policy):
            model = _untied_gpt()
            if policy != "none":
                checkpoint.recompute(model, checkpoint.GPT_POLICIES[policy])
            job = ShardedDataParallel(model, stage=3, comm=sub)
            gather, gathers = job._gather, []

            def counted(unit, async_op=False):
                gathers.append(unit.index)
                return gather(unit, async_op)
            job._gather = counted
            opt = torch.optim.SGD(job.parameters(), lr=0.1)
            losses, grads = [], []
            rows, me = 6 // ranks, sub.Get_rank()
            for step in range(3):
                x, y = train_gpt.batch(text, step, 6, 10, 0)
                x, y = x[me * rows:(me + 1) * rows], y[me * rows:(me + 1) * rows]
                loss = nn.functional.cross_entropy(job(x).reshape(-1, 24), y.reshape(-1))
                loss.backward()
                grads.append({n: p.grad.clone() for n, p in job.named_parameters()})
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().clone())
            return losses, (grads, sorted(gathers))

        base, (base_grads, base_gathers) = run("none")
        for policy in POLICIES:
            losses, (grads, gathers) = run(policy)
            problems += [f"{policy}: {d}" for d in _differences((base, base_grads),
                                                                (losses, grads))]
            if gathers != base_gathers:
                problems.append(f"{policy}: {len(gathers)} all-gathers in 3 steps, "
                                f"{len(base_gathers)} without recompute")
        sub.Free()
    assert_all(not problems, "; ".join(problems[:6]))


# -- MPI: every pipeline schedule ---------------------------------------------------------------

SCHEDULES = [("gpipe", 1, 0), ("1f1b", 1, 1), ("interleaved", 2, 0), ("zero_bubble", 1, 1)]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, virtual, zero", SCHEDULES,
                         ids=[s for s, _, _ in SCHEDULES])
def test_recompute_equals_none_in_every_pipeline_schedule(schedule, virtual, zero):
    """pp = 2 (x dp = 2 where there are 4 ranks, DDP or ZeRO-1): the losses and every stage's
    gradients with selective and full recompute equal those without."""
    from mpi4py import MPI

    from collectives import Mesh
    from collectives.torch import tensor_parallel as tp
    from collectives.torch.pipeline import gpt as pgpt
    from mpiutil import assert_all
    world = MPI.COMM_WORLD
    dp = 2 if world.Get_size() >= 4 else 1
    sub = _first(2 * dp)
    problems = []
    if sub is not None:
        mesh = Mesh((2, dp, 1), ("pp", "dp", "tp"), comm=sub)
        tp_comm = mesh.comm("tp")
        text = torch.arange(600) % 24
        rows, me = 8 // dp, mesh.coord("dp")

        def run(policy):
            torch.manual_seed(0)
            model = train_gpt.GPT(24, 16, 4, 4, "math")
            tp.parallelize(model, tp_comm, train_gpt.plan(model, False))
            job = pgpt.PipelinedGPT(
                model, mesh, schedule=schedule, microbatches=4, virtual=virtual, zero=zero,
                recompute=policy,
                loss_fn=lambda z, y: tp.vocab_parallel_cross_entropy(z, y, tp_comm))
            params = list(job.parameters())
            opt = torch.optim.SGD(params, lr=0.1)
            losses, grads = [], []
            for step in range(2):
                x, y = train_gpt.batch(text, step, 8, 10, 0)
                x, y = x[me * rows:(me + 1) * rows], y[me * rows:(me + 1) * rows]
                losses.append(job.step(x, y).detach().clone())
                grads.append({str(i): p.grad.clone() for i, p in enumerate(params)
                              if p.grad is not None})
                opt.step()
                opt.zero_grad()
            return losses, grads

        base = run("none")
        for policy in POLICIES:
            problems += [f"{policy}: {d}" for d in _differences(base, run(policy))]
        sub.Free()
    assert_all(not problems, "; ".join(problems[:6]))
