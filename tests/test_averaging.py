"""collectives.torch.averaging: periodic, hierarchical and DiLoCo averaging.

In-process tests (one rank) cover the choice of period, the checks and their messages, the
byte formula and checkpoints; MPI tests (``mpiexec -n 2``, ``3``; every n passes) compare
every averaging round with a mean taken by hand from every rank's tensors, check that the
ranks hold bitwise the same parameters and buffers after it and different ones between
rounds, that period 1 gives DDP's parameters, and that a setting that differs across ranks is
a ValueError on every rank. Every tolerance is float32's rounding of the arithmetic compared
(``rounding``): a mean over n ranks within ``rounding.average``, element-wise; SGD's steps
within ``rounding.sgd_parameters``; DiLoCo's outer Nesterov step carried through its momentum
(``_nesterov_bound``).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch import averaging  # noqa: E402
from collectives.torch.averaging import (DiLoCo, Hierarchical, Periodic,  # noqa: E402
                                         bandwidth_bytes, pick_level)
from mpiutil import assert_all, world  # noqa: E402

import rounding  # noqa: E402

torch.set_num_threads(1)

IN, HIDDEN, OUT, BATCH = 6, 16, 3, 8


def _net(seed=0, bn=True, hidden=HIDDEN):
    torch.manual_seed(seed)
    layers = [nn.Linear(IN, hidden)] + ([nn.BatchNorm1d(hidden)] if bn else []) + \
        [nn.Tanh(), nn.Linear(hidden, OUT)]
    return nn.Sequential(*layers)


def _train(model, opt, rank, step):
    """One step on this rank's batch of ``step`` (different data on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def _state(module, buffers=True) -> np.ndarray:
    """The parameters (and floating buffers) of ``module``, flat, as numpy."""
    ts = list(module.parameters())
    if buffers:
        ts += [b for b in module.buffers() if b.is_floating_point()]
    return torch.cat([t.detach().reshape(-1) for t in ts]).numpy().copy()


def _averaged_elements(module) -> int:
    return sum(p.numel() for p in module.parameters()) + \
        sum(b.numel() for b in module.buffers() if b.is_floating_point())


def _same(arrays) -> bool:
    return all(np.array_equal(a, arrays[0]) for a in arrays)


def _mean(arrays) -> np.ndarray:
    return np.mean([a.astype(np.float64) for a in arrays], axis=0)


def _stepped(net, opt, avg, comm, rank, step):
    """Train ``step`` on ``rank``'s data, then ``avg.step()``: every rank's state (parameters
    and buffers) before and after the averager's step."""
    _train(net, opt, rank, step)
    before = comm.allgather(_state(net))
    avg.step()
    return before, comm.allgather(_state(net))


def _ratio(diff, bound) -> float:
    """The largest ``|diff| / bound``, element-wise (infinite where a zero bound is missed)."""
    diff, bound = np.abs(np.asarray(diff, np.float64)), np.asarray(bound, np.float64)
    over = diff > bound
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(bound > 0, diff / np.where(bound > 0, bound, 1), np.where(over, np.inf, 0))
    return float(ratio.max()) if ratio.size else 0.0


def _off_mean(mine, before) -> float:
    """How far ``mine`` is from the mean of ``before`` (the states averaged by hand), as the
    largest ratio to float32's rounding of a mean over ``len(before)`` ranks (element-wise
    ``rounding.average`` of the inputs' mean magnitude): at most 1 for a true average."""
    scale = np.mean([np.abs(a.astype(np.float64)) for a in before], axis=0)
    return _ratio(mine - _mean(before), rounding.average(len(before), scale))


# -- in-process ----------------------------------------------------------------------------------
def test_the_documented_import():
    assert (averaging.Periodic, averaging.Hierarchical, averaging.DiLoCo) == \
        (Periodic, Hierarchical, DiLoCo)


def test_largest_dividing_period_picks_the_level():
    periods = [2, 4, 8]
    assert [pick_level(t, periods) for t in range(1, 17)] == \
        [None, 0, None, 1, None, 0, None, 2, None, 0, None, 1, None, 0, None, 2]
    assert [pick_level(t, [3]) for t in (1, 2, 3, 4, 6)] == [None, None, 0, None, 0]
    assert all(pick_level(t, [1]) == 0 for t in range(1, 5))
    assert [pick_level(t, [1, 5]) for t in (4, 5, 10)] == [0, 1, 1]


def test_bandwidth_bytes_is_two_n_minus_one_over_n():
    assert bandwidth_bytes(900, 3) == 1200
    assert bandwidth_bytes(1000, 2) == 1000
    assert bandwidth_bytes(1000, 1) == 0
    assert bandwidth_bytes(10, 4) == 15


@pytest.mark.parametrize("make, message", [
    (lambda net: Periodic(net, period=0), "Periodic: rank 0: period must be an integer >= 1, got 0"),
    (lambda net: Periodic(net, period=True), "period must be an integer >= 1, got True"),
    (lambda net: Periodic(net, period=4, warmup=-1), "warmup must be an integer >= 0, got -1"),
    (lambda net: Periodic(net, period=2.5), "period must be an integer >= 1, got 2.5"),
    (lambda net: Hierarchical(net, {"4": None}), "period must be an integer >= 1, got '4'"),
    (lambda net: DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), outer="adam"),
     "outer must be one of 'nesterov', 'sgd', got 'adam'"),
    (lambda net: DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), outer_lr=0),
     "outer_lr must be a positive number, got 0"),
    (lambda net: DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), outer_momentum=1),
     "outer_momentum must be in [0, 1), got 1"),
    (lambda net: DiLoCo(net, torch.optim.SGD(_net().parameters(), lr=0.1)),
     "inner_optimizer steps parameters that are not the model's"),
    (lambda net: DiLoCo(net, "sgd"), "inner_optimizer must be a torch.optim.Optimizer, got str"),
])
def test_bad_arguments_are_value_errors_naming_them(make, message):
    with pytest.raises(ValueError) as info:
        make(_net())
    assert message in str(info.value)


def test_argument_types():
    with pytest.raises(TypeError, match="non-empty dict"):
        Hierarchical(_net(), {})
    with pytest.raises(TypeError, match="the communicator of period 8 is 3, not an mpi4py"):
        Periodic(_net(), comm=3)
    with pytest.raises(TypeError, match="must be a torch.nn.Module, got list"):
        Periodic([], period=2)


def test_one_rank_averaging_is_a_no_op_that_counts_steps():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    avg = Periodic(net, period=2, warmup=1)
    for step in range(5):
        _train(net, opt, 0, step)
        before = _state(net)
        avg.step()
        assert np.array_equal(_state(net), before)
    assert (avg.step_count, avg.rounds, avg.bytes_sent, avg.payload_bytes) == (5, 3, 0, 0)
    assert avg.averaged_bytes == 4 * _averaged_elements(net)
    assert avg.bytes_per_step() == 0.0


def test_hierarchical_sorts_periods_and_mixed_dtypes_get_one_buffer_each():
    net = _net()
    net.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    net.register_buffer("count", torch.zeros(2, dtype=torch.int64))  # not averaged
    avg = Hierarchical(net, {8: None, 2: None})
    assert avg.periods == [2, 8]
    assert [g.flat.dtype for g in avg.groups] == [torch.float32, torch.float64]
    assert avg.averaged_bytes == 4 * (_averaged_elements(net) - 3) + 8 * 3


def test_ddp_keeps_its_hook_in_the_warmup_then_sends_nothing():
    from collectives.torch.hooks import allreduce_hook, noop_hook
    ddp = DDP(_net())
    state = ddp.comm_state
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    avg = Periodic(ddp, period=2, warmup=2)
    for step in range(3):
        assert ddp.reducer.hook is (allreduce_hook if step < 2 else noop_hook), step
        assert ddp.broadcast_buffers == (step < 2), step
        _train(ddp, opt, 0, step)
        avg.step()
    assert ddp.comm_state is state and state.wire_bytes == 2 * 4 * sum(
        p.numel() for p in ddp.parameters())
    assert avg.payload_bytes == state.wire_bytes and avg.bytes_sent == 0
    with pytest.raises(ValueError, match="driven by another averager"):
        Periodic(ddp, period=2)
    saved = avg.state_dict()
    fresh = DDP(_net())
    again = Periodic(fresh, period=2, warmup=2)
    again.load_state_dict(saved)
    assert fresh.reducer.hook is noop_hook and not fresh.broadcast_buffers
    assert again.payload_bytes == avg.payload_bytes and again.step_count == 3


def test_state_dict_round_trip():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    avg = DiLoCo(net, opt, period=2, outer_lr=0.7)
    for step in range(4):
        _train(net, opt, 0, step)
        avg.step()
    saved = avg.state_dict()
    glob = {k: v.clone() for k, v in avg.global_state().items()}
    momentum = [s["momentum_buffer"].clone() for s in avg.outer.state.values()]
    for step in range(4, 8):
        _train(net, opt, 0, step)
        avg.step()
    assert not torch.equal(avg.global_state()["0.weight"], glob["0.weight"])
    avg.load_state_dict(saved)
    assert avg.step_count == 4 and avg.rounds == 2
    assert all(torch.equal(avg.global_state()[k], v) for k, v in glob.items())
    assert all(torch.equal(s["momentum_buffer"], m)
               for s, m in zip(avg.outer.state.values(), momentum))
    with pytest.raises(ValueError, match="the state is a 'DiLoCo'"):
        Periodic(_net(), period=2).load_state_dict(saved)


def test_diloco_with_plain_sgd_and_lr_one_is_averaging():
    """outer='sgd', outer_lr=1: global - (global - mean) is the mean (here, one rank's), to
    float32's two roundings: s = (g - x)(1 + e1), then (g - s)(1 + e2) = (x - (g - x) e1)
    (1 + e2), within gamma(2) (|g - x| + |x|) of x; the buffers are copied, exactly."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    avg = DiLoCo(net, opt, outer="sgd", outer_lr=1.0, period=2)
    for step in range(4):
        _train(net, opt, 0, step)
        glob = avg.global_state()
        g = np.concatenate([glob[k].detach().double().reshape(-1).numpy()
                            for k, _ in net.named_parameters()])
        before = _state(net)
        avg.step()
        x = before[:g.size].astype(np.float64)
        bound = np.concatenate([rounding.gamma(2) * (np.abs(g - x) + np.abs(x)),
                                np.zeros(before.size - g.size)])
        err = _ratio(_state(net) - before.astype(np.float64), bound)
        assert err <= 1, f"step {step}: {err} times float32's rounding from the local values"


# -- MPI -----------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_period_one_gives_ddp_parameters():
    """Momentum SGD is linear in the gradients, so averaging the parameters after every local
    step is DDP's step on the averaged gradients, to float32's rounding: the gradients' (the
    layers' sums over IN + 1 and HIDDEN + 1, the loss's mean over BATCH x OUT, retraced
    backward, a weight's gradient summing BATCH rows, the mean over n ranks), carried through
    the steps by rounding.sgd_parameters from the largest local gradient of every rank, plus
    each step's parameter average (rounding.average of the largest parameter)."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    lr, mu = 0.1, 0.9
    ddp = DDP(_net(seed=r, bn=False))       # both start from rank 0's values
    plain = _net(seed=r, bn=False)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=mu)
    opt = torch.optim.SGD(plain.parameters(), lr=lr, momentum=mu)
    avg = Periodic(plain, period=1)
    terms = 2 * (IN + 1 + HIDDEN + 1 + BATCH * OUT + n) + BATCH + n
    grads = [[] for _ in plain.parameters()]
    largest = [float(q.detach().abs().max()) for q in plain.parameters()]
    for step in range(5):
        _train(ddp, opt_ddp, r, step)
        _train(plain, opt, r, step)
        for seen, q in zip(grads, plain.parameters()):
            seen.append(max(comm.allgather(float(q.grad.abs().max()))))
        avg.step()
        largest = [max(m, *comm.allgather(float(q.detach().abs().max())))
                   for m, q in zip(largest, plain.parameters())]
        ratios = [float((a - b).detach().abs().max()) /
                  (rounding.sgd_parameters(lr, terms, g, m, mu)
                   + (step + 1) * rounding.average(n, m))
                  for a, b, g, m in zip(ddp.module.parameters(), plain.parameters(), grads,
                                        largest)]
        assert_all(max(ratios) <= 1, f"step {step}: differences / float32's rounding "
                                     f"{ratios}")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_period_k_averages_parameters_and_buffers_as_by_hand():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    net = _net(seed=r)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    avg = Periodic(net, period=3)
    assert_all(_same(comm.allgather(_state(net))), "not started from rank 0's values")
    for step in range(7):
        before, after = _stepped(net, opt, avg, comm, r, step)
        if (step + 1) % 3 == 0:
            assert_all(_same(after), f"step {step + 1}: ranks differ after averaging")
            err = _off_mean(after[r], before)
            assert_all(err <= 1, f"step {step + 1}: {err} times float32's rounding from the "
                                 f"mean by hand")
        else:
            assert_all(np.array_equal(after[r], before[r]), f"step {step + 1} averaged")
            assert_all(n == 1 or not _same(after), f"step {step + 1}: ranks agree")
    assert_all(int(net[1].num_batches_tracked) == 7, "num_batches_tracked")
    # Bytes: two rounds of every parameter and floating buffer, 2 (n-1)/n each.
    payload = 2 * 4 * _averaged_elements(net) if n > 1 else 0
    assert_all(avg.averaged_bytes == 4 * _averaged_elements(net), f"{avg.averaged_bytes}")
    assert_all(avg.payload_bytes == payload and avg.rounds == 2, repr(avg))
    assert_all(avg.bytes_sent == payload * 2 * (n - 1) // n, f"{avg.bytes_sent} bytes sent")
    assert_all(avg.bytes_per_step() == avg.bytes_sent / 7, "bytes per step")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_each_dtype_is_averaged_in_its_own_buffer():
    """float32 and bfloat16 parameters and a float64 buffer: three flat buffers, three
    allreduces (bfloat16 divided first), each tensor the mean of rank-dependent values."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    net = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3).to(torch.bfloat16))
    net.register_buffer("scale", torch.zeros(7, dtype=torch.float64))
    avg = Periodic(net, period=1)
    tensors = list(net.parameters()) + [net.scale]
    with torch.no_grad():
        for k, t in enumerate(tensors):   # rank r holds (r + 1) * (k + 1) + i % 3
            t.copy_(((r + 1) * (k + 1) + torch.arange(t.numel()) % 3).view(t.shape))
    avg.step()
    ok = True
    for k, t in enumerate(tensors):
        # each rank's quotient and their sum round within rounding.average of the mean (the
        # inputs are positive), with the dtype's unit roundoff
        want = (n + 1) / 2 * (k + 1) + torch.arange(t.numel()) % 3
        unit = {torch.bfloat16: rounding.BF16_U, torch.float32: rounding.U,
                torch.float64: 2.0 ** -53}[t.dtype]
        tol = rounding.average(n, want.abs(), unit)
        ok &= bool(((t.detach().double().reshape(-1) - want).abs() <= tol).all())
        ok &= _same(comm.allgather(t.detach().float().numpy().copy()))
    assert_all(ok, "a tensor is not the mean, or differs across ranks")
    assert_all([g.flat.dtype for g in avg.groups] ==
               [torch.float32, torch.bfloat16, torch.float64], "groups")
    size = 4 * (5 * 4 + 4) + 2 * (4 * 3 + 3) + 8 * 7
    assert_all(avg.averaged_bytes == size and avg.payload_bytes == (size if n > 1 else 0),
               f"{avg.averaged_bytes}, {avg.payload_bytes}")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_warmup_of_a_module_averages_every_step_then_periodically():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    net = _net(seed=r)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    avg = Periodic(net, period=2, warmup=3)
    for t in range(1, 9):
        before, after = _stepped(net, opt, avg, comm, r, t)
        if t <= 3 or (t - 3) % 2 == 0:
            err = _off_mean(after[r], before)
            assert_all(_same(after) and err <= 1, f"step {t}: not averaged ({err} times "
                                                  f"float32's rounding from the mean)")
        else:
            assert_all(n == 1 or not _same(after), f"step {t}: averaged in local SGD")
    assert_all(avg.rounds == 5, f"{avg.rounds} rounds")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_warmup_of_a_ddp_allreduces_gradients_then_stops():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    ddp = DDP(_net(seed=r))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    avg = Periodic(ddp, period=3, warmup=2)
    grads = []   # the DDP's gradient payload after each step
    for t in range(1, 7):
        _train(ddp, opt, r, t)
        before = comm.allgather(_state(ddp.module))
        avg.step()
        grads.append(ddp.comm_state.wire_bytes)
        params = comm.allgather(_state(ddp.module, buffers=False))
        both = comm.allgather(_state(ddp.module))
        if t <= 2:   # DDP: the same gradients, so the same parameters, without averaging
            assert_all(_same(params) and both[r].tobytes() == before[r].tobytes(),
                       f"step {t}: warm-up")
        elif t == 5:
            err = _off_mean(both[r], before)
            assert_all(_same(both) and err <= 1, f"step {t}: not averaged ({err} times "
                                                 f"float32's rounding from the mean)")
        else:
            assert_all(n == 1 or not _same(params), f"step {t}: ranks agree in local SGD")
    per_step = grads[0]
    assert_all(per_step > 0 and grads == [per_step] * 1 + [2 * per_step] * 5,
               f"gradient bytes after each step: {grads}")
    assert_all(not ddp.broadcast_buffers, "buffers still broadcast after the warm-up")
    rounds = avg.averaged_bytes if n > 1 else 0
    assert_all(avg.payload_bytes == 2 * per_step + rounds, f"{avg.payload_bytes} payload")
    assert_all(avg.bytes_sent == bandwidth_bytes(2 * per_step, n) + bandwidth_bytes(rounds, n),
               f"{avg.bytes_sent} bytes sent")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_hierarchical_over_pairs_and_world_matches_hand_reference():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    pair = comm.Split(r // 2, r)
    try:
        mates = [q for q in range(n) if q // 2 == r // 2]
        net = _net(seed=r)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        avg = Hierarchical(net, {2: pair, 4: None})
        for t in range(1, 9):
            before, after = _stepped(net, opt, avg, comm, r, t)
            group = range(n) if t % 4 == 0 else mates if t % 2 == 0 else [r]
            err = _off_mean(after[r], [before[q] for q in group])
            assert_all(_same([after[q] for q in group]) and err <= 1,
                       f"step {t}: over ranks {list(group)}: {err} times float32's rounding "
                       f"from the mean by hand")
            if t % 2:
                assert_all(np.array_equal(after[r], before[r]), f"step {t} averaged")
        one = 4 * _averaged_elements(net)
        expect = [2 * one if len(mates) > 1 else 0, 2 * one if n > 1 else 0]
        assert_all(avg.payload == expect, f"payload per level {avg.payload}, not {expect}")
        assert_all(avg.bytes_sent == sum(bandwidth_bytes(p, s) for p, s in
                                         zip(expect, [len(mates), n])), f"{avg.bytes_sent}")
    finally:
        pair.Free()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_rebuild_on_survivors_keeps_each_pair_of_those_left():
    """``rebuild(comm)`` (elastic training, after a failure): the outermost level becomes
    ``comm`` and each pair is made again from its survivors. Rank 1 plays the dead one: the
    others rebuild on a communicator without it, and rank 0, whose mate is gone, then
    averages alone at period 2, while the pairs that survive whole average together."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    pair = comm.Split(r // 2, r)
    left = comm.Split(0 if r != 1 or n == 1 else 1, r)
    try:
        net = _net(seed=r)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        avg = Hierarchical(net, {2: pair, 4: None})
        _stepped(net, opt, avg, comm, r, 1)
        if r == 1 and n > 1:
            return
        avg.rebuild(left)
        survivors = [q for q in range(n) if q != 1 or n == 1]
        me = survivors.index(r)
        mates = [survivors.index(q) for q in survivors if q // 2 == r // 2]
        ok = avg.sizes == [len(mates), len(survivors)] and avg.comm is left
        for t in range(2, 5):
            before, after = _stepped(net, opt, avg, left, r, t)
            group = range(len(survivors)) if t % 4 == 0 else mates if t % 2 == 0 else [me]
            err = _off_mean(after[me], [before[q] for q in group])
            ok &= _same([after[q] for q in group]) and err <= 1
        assert all(left.allgather(ok)), f"rank {r}: sizes {avg.sizes}, averaging groups"
    finally:
        comm.Barrier()
        pair.Free()
        left.Free()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_hierarchical_communicators_must_nest():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        pytest.skip("needs two ranks")
    pair, parity = comm.Split(r // 2, r), comm.Split(r % 2, r)
    try:
        try:
            Hierarchical(_net(), {2: pair, 4: parity})
            raised = None
        except ValueError as e:
            raised = str(e)
        assert_all(raised is not None and "is not inside that of period 4" in raised,
                   f"rank {r}: {raised}")
    finally:
        pair.Free()
        parity.Free()


def _nesterov_bound(n, lr, mu, glob, local, delta, momentum, before, error):
    """How far DiLoCo's float32 outer step may lie from the hand's float64 one, element-wise,
    and the momentum buffer's bound to carry into the next round. ``glob``: the global copy
    before the round; ``local``: every rank's parameters; ``delta``, ``momentum``: the hand's
    averaged pseudo-gradient and buffer; ``before``, ``error``: the hand's last buffer and the
    float32 one's bound (None in the first round). Each rank rounds g - x once, divides it by
    n and the quotients are summed (``op="avg"``: n + 1 roundings of terms of mean magnitude
    mean |g - x_r|, one to spare for the hand's mean: gamma(n + 2)); torch's SGD then rounds
    b = mu b + d (mu's float32 value and the product: gamma(2) mu |b|, the sum: U), the
    Nesterov gradient d + mu b the same way, and p = g - lr (d + mu b) (lr's float32 value and
    the product: gamma(2) lr |G|, the difference: U |p|); the hand's float64 roundings, a few
    of 2^-53 each, lie within 2^-50 of the magnitudes."""
    u = rounding.gamma(1)
    e_d = rounding.gamma(n + 2) * sum((glob - x).abs() for x in local) / len(local)
    if before is None:
        e_b = e_d
    else:
        pre = mu * error + e_d + rounding.gamma(2) * mu * (before.abs() + error)
        e_b = pre + u * (momentum.abs() + pre)
    grad = delta + mu * momentum
    pre = e_d + mu * e_b + rounding.gamma(2) * mu * (momentum.abs() + e_b)
    e_g = pre + u * (grad.abs() + pre)
    step = lr * e_g + rounding.gamma(2) * lr * (grad.abs() + e_g)
    e_p = step + u * ((glob - lr * grad).abs() + step) + \
        2.0 ** -50 * (glob.abs() + lr * (grad.abs() + e_g))
    return e_p, e_b


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_diloco_outer_step_is_nesterov_on_the_averaged_delta():
    """Each round's parameters are the outer Nesterov step by hand (float64, from the global
    copy and every rank's parameters), within float32's rounding of the average, the momentum
    buffer (carried through the rounds) and the step (``_nesterov_bound``); the buffers within
    rounding.average of their mean. AdamW trains inside: the hand starts from what it gave."""
    comm = world()
    r = comm.Get_rank()
    net = _net(seed=r)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    lr, mu = 0.7, 0.9
    avg = DiLoCo(net, opt, outer="nesterov", outer_lr=lr, period=2)
    names = [n for n, _ in net.named_parameters()]
    buffer_names = [n for n, b in net.named_buffers() if b.is_floating_point()]
    momentum = error = None
    for t in range(1, 7):
        _train(net, opt, r, t)
        if t % 2:
            avg.step()
            continue
        glob = {k: v.double() for k, v in avg.global_state().items()}
        local = comm.allgather({k: v.detach().clone() for k, v in net.state_dict().items()})
        avg.step()
        delta = {k: glob[k] - sum(d[k].double() for d in local) / len(local) for k in names}
        last = momentum
        momentum = delta if momentum is None else {k: mu * momentum[k] + delta[k]
                                                   for k in names}
        hand = {k: glob[k] - lr * (delta[k] + mu * momentum[k]) for k in names}
        hand.update({k: sum(d[k].double() for d in local) / len(local) for k in buffer_names})
        bound, error = {}, {} if error is None else error
        for k in names:
            bound[k], error[k] = _nesterov_bound(
                len(local), lr, mu, glob[k], [d[k].double() for d in local], delta[k],
                momentum[k], None if last is None else last[k], error.get(k))
        for k in buffer_names:
            bound[k] = rounding.average(len(local), sum(d[k].double().abs() for d in local)
                                        / len(local))
        now = net.state_dict()
        err = max(_ratio(now[k].double() - hand[k], bound[k]) for k in hand)
        assert_all(err <= 1, f"step {t}: {err} times float32's rounding from the Nesterov "
                             f"step by hand")
        assert_all(all(torch.equal(now[k], v) for k, v in avg.global_state().items()),
                   "parameters are not the global copy")
        assert_all(_same(comm.allgather(_state(net))), f"step {t}: ranks differ")
    assert_all(avg.rounds == 3, f"{avg.rounds} rounds")


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["warmup", "period", "outer_lr", "kind", "bad_period",
                                  "tensors"])
def test_settings_that_differ_are_value_errors_on_every_rank(case):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        pytest.skip("needs two ranks")
    odd = int(r == n - 1)
    net = _net(hidden=HIDDEN + (odd if case == "tensors" else 0))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    make, expect = {
        "warmup": (lambda: Periodic(net, period=4, warmup=5 + odd),
                   f"Periodic: warmup differs across ranks: rank 0 has 5; rank {n - 1} has 6"),
        "period": (lambda: Periodic(net, period=4 + 4 * odd),
                   f"period differs across ranks: rank 0 has 4; rank {n - 1} has 8"),
        "outer_lr": (lambda: DiLoCo(net, opt, outer_lr=0.5 if odd else 0.7, period=4),
                     f"outer_lr differs across ranks: rank 0 has 0.7; rank {n - 1} has 0.5"),
        "kind": (lambda: (DiLoCo(net, opt, period=4) if odd else Periodic(net, period=4)),
                 f"kind differs across ranks: rank 0 has 'Periodic'; rank {n - 1} has "
                 f"'DiLoCo'"),
        "bad_period": (lambda: Periodic(net, period=0 if odd else 4),
                       f"Periodic: rank {n - 1}: period must be an integer >= 1, got 0"),
        "tensors": (lambda: Periodic(net, period=4),
                    f"rank {n - 1} has '0.weight' of shape [{HIDDEN + 1}, {IN}]"),
    }[case]
    try:
        make()
        raised = None
    except ValueError as e:
        raised = str(e)
    assert_all(raised is not None and expect in raised, f"rank {r}: {raised}")
