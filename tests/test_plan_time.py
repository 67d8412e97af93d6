"""The planner's time model on measured compute: what a measurement may and may not change."""
import pytest

from collectives import plan
from collectives.plan import Plan
from collectives.plan.timing import layer_time


class _Noisy:
    """Compute as a noisy probe may report it: the recomputed blocks' backward faster than the
    plain block's."""

    def layer(self, model, b, tp, sp, recompute):
        return 1e-3, {"none": 4e-3, "selective": 3e-3, "full": 5e-3}[recompute]

    def head(self, model, b, tp, sp):
        return 1e-3, 2e-3

    def optimizer(self, params):
        return 1e-4


def test_a_recomputed_block_is_never_priced_cheaper_than_the_plain_one():
    """Recompute runs the plain backward and part of the forward again: a probe that found it
    cheaper than that measured noise, and the plain backward plus that part's share of the
    forward's operations is its price; a slower measurement stands. Plans that differ only in
    recompute are then ranked by what recompute costs, not by that noise."""
    shape = plan.gpt(4, 64, 4, 32, 256, attention="math")
    noisy = _Noisy()
    core = 4 * 32 ** 2 * 64 / shape.layer_flops(1)    # the attention core's share, b = 1
    assert 0 < core < 1
    assert layer_time(noisy, shape, 1, 1, False, "none") == (1e-3, 4e-3)
    assert layer_time(noisy, shape, 1, 1, False, "selective") == \
        pytest.approx((1e-3, 4e-3 + core * 1e-3))
    assert layer_time(noisy, shape, 1, 1, False, "full") == pytest.approx((1e-3, 5e-3))

    class Slow(_Noisy):
        def layer(self, model, b, tp, sp, recompute):
            return 1e-3, {"none": 4e-3, "selective": 4.5e-3, "full": 6e-3}[recompute]

    assert layer_time(Slow(), shape, 1, 1, False, "selective") == (1e-3, 4.5e-3)
    assert layer_time(Slow(), shape, 1, 1, False, "full") == (1e-3, 6e-3)
    net = plan.Network(ranks_per_node=8)
    for dp, pp, schedule, m in ((4, 1, "1f1b", 1), (2, 2, "1f1b", 4), (1, 4, "zero_bubble", 4)):
        steps = {r: plan.step_time(shape, Plan(dp, 1, pp, False, schedule, 1, m, 0, r, 1),
                                   net, noisy)[0] for r in ("none", "selective", "full")}
        assert steps["none"] < steps["selective"] < steps["full"]
        bounds = {r: plan.lower_bound(shape, Plan(dp, 1, pp, False, schedule, 1, m, 0, r, 1),
                                      net, noisy) for r in ("none", "selective")}
        assert bounds["none"] < bounds["selective"]
