"""collectives.torch.tensor_parallel: examples/train_gpt.py's GPT at tp = 2 and 3 and dp x tp =
2 x 2, with and without sequence parallelism, against one process on the whole batch; the
layers with biases under sequence parallelism; bad input on every rank; parameter memory; torch's
own clients (DTensor, FSDP2) on the Mesh's groups.

Each MPI test runs on a sub-communicator of the first ranks it needs (the other ranks wait at the
next test), so it runs at every rank count that holds it and skips below; the GPT's equivalence
cases, the slowest, run at the rank count they need and at one more."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.tp import train_gpt_module  # noqa: E402

train_gpt = train_gpt_module()

from collectives.torch import tensor_parallel as tp  # noqa: E402

import rounding  # noqa: E402

pytestmark = pytest.mark.timeout(240)

TINY = ["--vocab", "264", "--dim", "24", "--heads", "6", "--layers", "2", "--seq", "12",
        "--batch", "4", "--steps", "5", "--lr", "0.01", "--corpus-bytes", "65536"]


def _args(*extra):
    return train_gpt.parser().parse_args(TINY + list(extra))


def _first(n):
    """A communicator of world ranks 0..n-1 (None on the others), or a skip below n ranks."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() < n:
        pytest.skip(f"needs {n} ranks")
    sub = world.Split(0 if world.Get_rank() < n else MPI.UNDEFINED, world.Get_rank())
    return None if sub == MPI.COMM_NULL else sub


def _agree(ok, message, comm):
    """Every rank of the job learns whether any failed (ranks outside ``comm`` pass ok)."""
    from mpiutil import assert_all
    assert_all(ok, message)


def test_plan_naming_no_module_is_an_error():
    from mpi4py import MPI
    model = train_gpt.GPT(16, 8, 2, 1)
    with pytest.raises(ValueError, match=r"plan entries \['blocks.\*.attn.qkvx'\] name no module"):
        tp.parallelize(model, MPI.COMM_SELF, {"blocks.*.attn.qkvx": "colwise"})
    with pytest.raises(ValueError, match="style 'colwise' converts a Linear, this is a LayerNorm"):
        tp.parallelize(model, MPI.COMM_SELF, {"norm": "colwise"})
    with pytest.raises(ValueError, match="style 'diagonal'"):
        tp.parallelize(model, MPI.COMM_SELF, {"norm": "diagonal"})
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="1: its weight is tied to 0's, which splits it along "
                                         "dimension 0, this layer along 1"):
        tp.parallelize(tied, MPI.COMM_SELF, {"0": "colwise", "1": "rowwise"})
    assert type(tied[0]) is nn.Linear  # checked before any layer was converted


def test_vocab_cross_entropy_of_one_rank_is_cross_entropy():
    from mpi4py import MPI
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 11, generator=g, requires_grad=True)
    target = torch.randint(0, 11, (4, 5), generator=g)
    ours = tp.vocab_parallel_cross_entropy(logits, target, MPI.COMM_SELF)
    (ga,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1))
    (gb,) = torch.autograd.grad(ref, logits)
    # terms: the log-sum-exp over 11 logits and the mean over 20 tokens, forward and back; the
    # loss's terms are within |loss| + the largest logit, the gradient's ((p - onehot) / 20)
    # within 1 / 20
    n = 2 * (11 + 20)
    scale = float(ref.abs()) + float(logits.detach().abs().max())
    assert abs(float(ours) - float(ref)) <= rounding.agree(n, scale), (float(ours), float(ref))
    assert float((ga - gb).abs().max()) <= rounding.agree(n, 1 / 20)


CASES = [(2, 1, False, 0), (2, 1, True, 0), (3, 1, False, 0), (3, 1, True, 0),
         (2, 2, False, 0), (2, 2, True, 0), (2, 2, True, 2)]


def _gpt_terms(args, ranks: int) -> int:
    """The terms a float32 value of the GPT adds up along its longest path: per block two
    norms, q/k/v, scores over a head, softmax and weights over the sequence, the projection
    and the MLP's two layers; then the last norm, the head and cross-entropy's sum over the
    vocabulary; backward retraces all of it, a weight's gradient sums every token of the
    batch, and the ranks add their partial sums."""
    d, t = args.dim, args.seq
    block = 2 * d + d + d // args.heads + 2 * t + d + d + 4 * d
    forward = args.layers * block + d + d + args.vocab
    return 2 * forward + args.batch * t + ranks


def _sgd_run(args, mesh, text, lr):
    """``args.steps`` steps of plain SGD on the example's model (``train_gpt.build``), the loss
    averaged over "dp" as ``train_gpt.train`` does; returns (losses, the loss's scale per step
    (|loss| + the largest logit), the largest gradient of each parameter per step, the largest
    parameter, the model, the inner module)."""
    import collectives as coll
    model, inner, _, loss_fn = train_gpt.build(args, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dp = 1 if mesh is None else mesh.size("dp")
    rows = args.batch // dp
    me = 0 if mesh is None else mesh.coord("dp")
    losses, scales, grads, params = [], [], {}, {}
    for step in range(args.steps):
        x, y = train_gpt.batch(text, step, args.batch, args.seq, args.seed)
        logits = model(x[me * rows:(me + 1) * rows])
        loss = loss_fn(logits, y[me * rows:(me + 1) * rows])
        loss.backward()
        for k, v in inner.state_dict(keep_vars=True).items():
            if v.grad is not None:  # ZeRO's inner parameters hold none: the shards do
                grads.setdefault(k, []).append(float(v.grad.abs().max()))
            params[k] = max(params.get(k, 0.0), float(v.detach().abs().max()))
        opt.step()
        opt.zero_grad()
        value = loss.detach().reshape(1)
        if dp > 1:
            value = coll.allreduce(value, op="avg", comm=mesh.comm("dp"))
        losses.append(float(value))
        scales.append(abs(float(value)) + float(logits.detach().abs().max()))
    for k, v in inner.state_dict().items():
        params[k] = max(params[k], float(v.abs().max()))
    return losses, scales, grads, params, model, inner


@pytest.mark.mpi
@pytest.mark.parametrize("tp_size, dp, sp, zero", CASES,
                         ids=[f"tp{t}-dp{d}{'-sp' if s else ''}{f'-zero{z}' if z else ''}"
                              for t, d, s, z in CASES])
def test_gpt_equals_one_process(tp_size, dp, sp, zero):
    """Loss at every step and parameters after 5 SGD steps equal one process on the whole
    batch within float32's rounding of the computation (``rounding``: SGD's step is
    proportional to the gradient, so a wrong or missing rank's contribution moves a weight by
    a share of ``lr`` times its gradient, far outside the bound); the norms identical on every
    rank of a tp group."""
    from mpi4py import MPI

    from collectives import Mesh
    if MPI.COMM_WORLD.Get_size() > tp_size * dp + 1:
        pytest.skip(f"runs at n = {tp_size * dp} and {tp_size * dp + 1} (a rank outside the "
                    f"mesh), which bounds the suite's time")
    comm = _first(tp_size * dp)
    msgs = []
    if comm is not None:
        extra = ["--zero", str(zero)] + (["--sequence-parallel"] if sp else [])
        args = _args(*extra)
        lr = 0.1
        n = _gpt_terms(args, tp_size * dp)
        text = train_gpt.corpus(args.corpus_bytes)
        ref_losses, scales, grads, params, ref_model, _ = _sgd_run(args, None, text, lr)
        mesh = Mesh((dp, tp_size), ("dp", "tp"), comm=comm)
        losses, _, _, _, model, inner = _sgd_run(args, mesh, text, lr)
        tpc = mesh.comm("tp")
        for s, (a, b) in enumerate(zip(losses, ref_losses)):
            if abs(a - b) > rounding.agree(n, scales[s]):
                msgs.append(f"step {s}: loss {a} vs one process {b} (bound "
                            f"{rounding.agree(n, scales[s]):.3g})")
        state = model.full_state_dict() if zero else None
        full = tp.full_state_dict(inner, tpc, state)
        for k, v in ref_model.state_dict().items():
            bound = rounding.sgd_parameters(lr, n, grads[k], params[k])
            worst = float((full[k] - v).abs().max())
            if not worst <= bound:
                msgs.append(f"{k}: largest difference {worst:.3g}, bound {bound:.3g}")
        if not zero:  # the norms as this rank holds them, bitwise against the tp group's
            for k, v in inner.state_dict().items():
                if "norm" in k:
                    every = tp._all_gather(v.detach().reshape(1, -1), 0, tpc)
                    if not bool((every == every[0]).all()):
                        msgs.append(f"{k} differs across the tp group")
        if len(losses) != 5:
            msgs.append(f"{len(losses)} steps")
    _agree(not msgs, "; ".join(msgs[:6]), comm)


@pytest.mark.mpi
@pytest.mark.parametrize("tp_size", [2, 3])
def test_layers_with_biases_under_sequence_parallelism(tp_size):
    """LayerNorm, column- and row-parallel linear with biases, sequence split: output slices and
    every gradient (through full_state_dict after one SGD step) equal the dense module's."""
    comm = _first(tp_size)
    msgs = []
    if comm is not None:
        r = comm.Get_rank()
        torch.manual_seed(0)
        dense = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
        model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
        model.load_state_dict(dense.state_dict())
        tp.parallelize(model, comm, {"0": "sequence", "1": "colwise", "3": "rowwise"})
        x = torch.randn(2, 3 * tp_size, 6, generator=torch.Generator().manual_seed(1))
        t = 3
        mine = model(x[:, r * t:(r + 1) * t])
        want = dense(x)
        # terms: the norm's mean and variance over 6, the layers' sums over 6 and 12, the ranks'
        # partial sums; backward retraces them and a weight's gradient sums 2 x 3 tp tokens
        n = 2 * (2 * 6 + 6 + 12 + tp_size) + 6 * tp_size
        worst = float((mine - want[:, r * t:(r + 1) * t]).abs().max())
        if not worst <= rounding.agree(n, _last_layer_terms(dense, x)):
            msgs.append(f"output: {worst}")
        # the loss of the whole sequence: this rank's tokens' share, summed over ranks
        msgs += _after_one_sgd_step(model, mine, dense, want, comm, n)
    _agree(not msgs, "; ".join(msgs), comm)


@pytest.mark.mpi
def test_rebind_repoints_the_layers_and_the_sequence_parallel_hooks(monkeypatch):
    """``tp.rebind`` onto another communicator of the same ranks (a survivors' group after a
    failure): every layer and every hook that sums a replicated parameter's gradient use it,
    and the gradients are the ones before."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 60), nn.GELU(), nn.Linear(60, 6))
    tp.parallelize(model, comm, {"0": "sequence", "1": "colwise", "3": "rowwise"}, seq_dim=1)
    x = torch.randn(2, 3 * n, 6, generator=torch.Generator().manual_seed(1))[:, 3 * r:3 * r + 3]

    def grads():
        model.zero_grad()
        model(x).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    before = grads()
    new = comm.Dup()
    used = []
    sums = tp._all_reduce
    monkeypatch.setattr(tp, "_all_reduce", lambda t, c: used.append(c) or sums(t, c))
    tp.rebind(model, new)
    after = grads()
    monkeypatch.undo()
    layers = [m for m in model.modules() if getattr(m, "tp_split", None)]
    hooked = n > 1     # one rank: nothing to sum, no hook
    ok = all(m.comm is new for m in layers) and all(c is new for c in used)
    ok &= (len(used) > 0) == hooked and all(map(torch.equal, before, after))
    assert all(comm.allgather(ok)), f"rank {r}: {len(used)} sums, comms {set(map(id, used))}"
    new.Free()


def _last_layer_terms(dense, x) -> float:
    """The largest magnitude of the terms ``dense``'s last linear layer adds up on input ``x``
    (``|W| |h| + |b|``): the scale of its outputs' rounding."""
    last = dense[-1]
    h = dense[:-1](x).detach().abs()
    return float((h @ last.weight.detach().abs().T + last.bias.detach().abs()).max())


def _after_one_sgd_step(model, mine, dense, want, comm, n) -> list[str]:
    """One SGD step (lr 0.1) of the loss sum(output ** 2) on ``model`` and ``dense``; the
    parameters of ``model``'s full state dict that then differ from ``dense``'s by more than
    ``rounding.sgd_parameters`` allows for gradients of ``n`` terms."""
    lr = 0.1
    mine.pow(2).sum().backward()
    want.pow(2).sum().backward()
    bounds = {k: rounding.sgd_parameters(lr, n, [float(v.grad.abs().max())],
                                         float(v.detach().abs().max()))
              for k, v in dense.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        for net in (model, dense):
            for p in net.parameters():
                p -= lr * p.grad
    full = tp.full_state_dict(model, comm)
    worst = {k: float((full[k] - v).abs().max()) for k, v in dense.state_dict().items()}
    return [f"{k}: {worst[k]}, bound {bounds[k]:.3g}" for k in worst
            if not worst[k] <= bounds[k]]


@pytest.mark.mpi
@pytest.mark.parametrize("tp_size", [2, 3])
def test_layers_built_directly(tp_size):
    """ColumnParallelLinear(gather_output=True) into RowParallelLinear(input_is_parallel=False)
    and VocabParallelEmbedding, loaded from a dense model's full weights: outputs and the
    gradients (full_state_dict after one SGD step) equal the dense model's."""
    comm = _first(tp_size)
    msgs = []
    if comm is not None:
        torch.manual_seed(0)
        dense = nn.Sequential(nn.Embedding(6 * tp_size, 4), nn.Linear(4, 6 * tp_size),
                              nn.Tanh(), nn.Linear(6 * tp_size, 5))
        model = nn.Sequential(
            tp.VocabParallelEmbedding(6 * tp_size, 4, comm=comm),
            tp.ColumnParallelLinear(4, 6 * tp_size, comm=comm, gather_output=True), nn.Tanh(),
            tp.RowParallelLinear(6 * tp_size, 5, comm=comm, input_is_parallel=False))
        tp.load_full_state_dict(model, dense.state_dict(), comm)
        ids = torch.randint(0, 6 * tp_size, (3, 7), generator=torch.Generator().manual_seed(2))
        mine, want = model(ids), dense(ids)
        # terms: the layers' sums over 4 and 6 tp, the ranks' partial sums; backward retraces
        # them and a weight's gradient sums the 21 tokens
        n = 2 * (4 + 6 * tp_size + tp_size) + 21
        worst = float((mine - want).abs().max())
        if not worst <= rounding.agree(n, _last_layer_terms(dense, ids)):
            msgs.append(f"output: {worst}")
        msgs += _after_one_sgd_step(model, mine, dense, want, comm, n)
    _agree(not msgs, "; ".join(msgs), comm)


def _raises(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.mpi
def test_bad_input_is_an_error_on_every_rank():
    comm = _first(2)
    msgs = []
    if comm is not None:
        r = comm.Get_rank()
        # heads: 3 heads of 8 do not split over 2 ranks (the qkv unit is 3 * 8)
        model = train_gpt.GPT(264, 24, 3, 1)
        got = _raises(lambda: tp.parallelize(model, comm, train_gpt.plan(model, False)))
        if not got or "blocks.0.attn.qkv" not in got or "72 are 3 blocks of 24" not in got:
            msgs.append(f"heads: {got}")
        # hidden size: 7 output features over 2 ranks
        odd = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 4))
        got = _raises(lambda: tp.parallelize(odd, comm, {"0": "colwise", "1": "rowwise"}))
        if not got or "0: out_features 7 is not divisible by the tensor-parallel size 2" \
                not in got:
            msgs.append(f"hidden: {got}")
        # a layer whose full shape differs across ranks
        diff = nn.Sequential(nn.Linear(4, 8 + 2 * r))
        got = _raises(lambda: tp.parallelize(diff, comm, {"0": "colwise"}))
        if not got or "rank 0 has 0 colwise weight (8, 4)" not in got or \
                "rank 1 has 0 colwise weight (10, 4)" not in got:
            msgs.append(f"shapes: {got}")
        # the plan names no module (every rank, before any collective)
        one = nn.Sequential(nn.Linear(4, 4))
        got = _raises(lambda: tp.parallelize(one, comm, {"9": "rowwise"}))
        if not got or "name no module" not in got:
            msgs.append(f"plan: {got}")
        # the plan names a module on rank 0 only: every rank raises rank 1's error
        lopsided = nn.Sequential(nn.Linear(4, 4)) if r == 0 else nn.Sequential(nn.ReLU())
        got = _raises(lambda: tp.parallelize(lopsided, comm, {"0": "colwise"}))
        if not got or "parallelize: rank 1: 0: style 'colwise' converts a Linear" not in got:
            msgs.append(f"one-sided plan: {got}")
        # a sequence that sequence parallelism cannot split
        torch.manual_seed(0)
        gpt = train_gpt.GPT(264, 24, 6, 1)
        tp.parallelize(gpt, comm, train_gpt.plan(gpt, True))
        got = _raises(lambda: gpt(torch.zeros(2, 5, dtype=torch.long)))
        if not got or "length 5 (the sequence under sequence parallelism)" not in got:
            msgs.append(f"sequence: {got}")
        # the communicator still works: nothing was left half started
        s = tp._all_reduce(torch.ones(3), comm)
        if not torch.equal(s, torch.full((3,), 2.0)):
            msgs.append(f"allreduce after the errors: {s}")
    _agree(not msgs, "; ".join(msgs), comm)


@pytest.mark.mpi
@pytest.mark.parametrize("tp_size", [2, 3])
def test_parameter_bytes_are_one_over_tp(tp_size):
    comm = _first(tp_size)
    msgs = []
    if comm is not None:
        torch.manual_seed(0)
        plain = train_gpt.GPT(264, 24, 6, 2)
        layers = [plain.embed.weight] + [m.weight for n, m in plain.named_modules()
                                         if isinstance(m, nn.Linear) and n != "head"]
        full_bytes = sum(p.numel() * p.element_size() for p in layers)
        torch.manual_seed(0)
        model = train_gpt.GPT(264, 24, 6, 2)
        tp.parallelize(model, comm, train_gpt.plan(model, True))
        here, full = tp.sharded_parameter_bytes(model)
        mine = sum(p.numel() * p.element_size() for p in model.parameters())
        norms = sum(p.numel() * p.element_size() for n, p in plain.named_parameters()
                    if "norm" in n)
        if full != full_bytes or here * tp_size != full_bytes or mine != here + norms:
            msgs.append(f"here {here}, full {full}, plain {full_bytes}, all {mine}")
        if model.head.weight is not model.embed.weight:
            msgs.append("the head is no longer tied to the embedding")
        # a checkpoint round trip: full weights back, and loaded into a fresh conversion
        state = tp.full_state_dict(model, comm)
        if any(not torch.equal(state[k], v) for k, v in plain.state_dict().items()):
            msgs.append("full_state_dict differs from the plain model")
        torch.manual_seed(5)  # other full weights: the loaded state must replace them
        again = tp.parallelize(train_gpt.GPT(264, 24, 6, 2), comm, train_gpt.plan(model, True))
        tp.load_full_state_dict(again, state, comm)
        if any(not torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                     model.state_dict().values())):
            msgs.append("load_full_state_dict")
    _agree(not msgs, "; ".join(msgs), comm)


@pytest.mark.mpi
def test_torch_clients_take_the_mesh_groups(process_group):
    """DTensor's parallelize_module on mesh.group("tp") and FSDP2 on mesh.group("dp") train a
    2 x 2 model like one process."""
    from mpi4py import MPI
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from collectives import Mesh
    from mpiutil import assert_all
    if MPI.COMM_WORLD.Get_size() != 4:
        pytest.skip("needs 4 ranks (torch's groups span COMM_WORLD)")
    mesh = Mesh((2, 2), ("dp", "tp"))
    dm = DeviceMesh.from_group([mesh.group("dp"), mesh.group("tp")], "cpu",
                               mesh=torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=dm["dp"])
    # SGD: its step is proportional to the gradient, so float32's rounding bounds how far the
    # two may drift (``rounding``); Adam's lr-sized steps would not be bounded below 2 lr
    lr = 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    d = mesh.coord("dp")
    grads = [[] for _ in ref.parameters()]
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        F.mse_loss(model(x[d * 4:(d + 1) * 4]), y[d * 4:(d + 1) * 4]).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        for seen, p in zip(grads, ref.parameters()):
            seen.append(float(p.grad.abs().max()))
        ref_opt.step()
        ref_opt.zero_grad()
    # terms: the layers' sums over 8 and 16, the loss's mean over 64, the ranks' partial sums
    # (4); backward retraces them and a weight's gradient sums the 8 rows
    n = 2 * (8 + 16 + 64 + 4) + 8
    full = [p.full_tensor().detach() for p in model.parameters()]
    # a parameter's largest value over the steps: its last one, give or take the steps taken
    worst = [(float((a - b).abs().max()), rounding.sgd_parameters(
              lr, n, seen, float(b.detach().abs().max()) + lr * sum(seen)))
             for a, b, seen in zip(full, ref.parameters(), grads)]
    assert_all(all(w <= bound for w, bound in worst), f"(largest difference, bound): {worst}")


@pytest.mark.timeout(300)
def test_example_prints_one_over_tp_parameter_bytes():
    """``mpiexec -n 2 examples/train_gpt.py --tp 2``: the JSON summary's tp parameter bytes are
    half the full layers', and the loss equals the one-rank run's (in-process tier: this test
    launches the jobs)."""
    import json
    import subprocess
    from pathlib import Path
    if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("mpiexec not found beside the interpreter")
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(PYTHONUNBUFFERED="1", MPIEXEC_TIMEOUT="240")
    out = {}
    for n in (1, 2):
        done = subprocess.run([str(mpiexec), "-n", str(n), sys.executable,
                               str(root / "examples" / "train_gpt.py"), "--tp", str(n),
                               "--sequence-parallel", "--steps", "1", "--dim", "48"],
                              capture_output=True, text=True, timeout=270, env=env, cwd=root)
        assert done.returncode == 0, done.stdout + done.stderr
        out[n] = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = out[1], out[2]
    assert two["tp_param_bytes_per_rank"] * 2 == two["tp_param_bytes_full"] \
        == one["tp_param_bytes_per_rank"], (one, two)
    assert two["tp_bytes_per_step"] > 0 == one["tp_bytes_per_step"]
    # The loss of the first step, before any update (after AdamW steps, lr-sized whatever the
    # gradient, no tolerance below 2 lr a step holds: test_gpt_equals_one_process trains with
    # SGD). Terms: per block two norms, q/k/v, a head's scores, softmax and weights over the
    # sequence, the projection and the MLP (dim 48, 6 heads, sequence 96), then the last norm,
    # the head and the vocabulary (264), and the mean over 8 x 96 tokens. At initialisation the
    # logits are far below the loss (about ln 264), so the terms lie within twice the loss; each
    # printed loss is rounded to 5 decimals.
    d, t, layers, ranks = 48, 96, 2, 2
    n = layers * (2 * d + d + d // 6 + 2 * t + d + d + 4 * d) + d + d + 264 + 8 * t + ranks
    bound = rounding.agree(n, 2 * one["loss"]) + 1e-5
    assert abs(two["loss"] - one["loss"]) <= bound, (one, two, bound)
