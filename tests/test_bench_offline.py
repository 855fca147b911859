"""bench.offline's mixed-shape family (issue 17 item 4): fixed, varied shapes drawn from seeds."""

from __future__ import annotations

from bench.offline import FAMILY, family_shape, make_workload


def test_family_shapes_are_fixed_and_varied():
    shapes = [family_shape(i) for i in range(len(FAMILY))]
    assert shapes == [family_shape(i) for i in range(len(FAMILY))]  # the same every run
    assert shapes[0] == (32, (64, 384), (32, 160))  # the shape a user tried
    counts = {n for n, _, _ in shapes}
    assert counts <= {16, 32, 64, 128} and len(counts) >= 3
    for _, (p_lo, p_hi), (o_lo, o_hi) in shapes:
        assert 1 <= p_lo < p_hi and 1 <= o_lo < o_hi
    assert len({p for _, p, _ in shapes}) >= 4 and len({o for _, _, o in shapes}) >= 4


def test_family_workloads_follow_their_shape():
    for i, name in enumerate(FAMILY):
        n, (p_lo, p_hi), (o_lo, o_hi) = family_shape(i)
        wl = make_workload(name, vocab=49152, seed=0)
        assert wl.name == name and len(wl.prompts) == len(wl.output_lens) == n
        assert all(p_lo <= len(p) <= p_hi for p in wl.prompts)
        assert all(o_lo <= o <= o_hi for o in wl.output_lens)
        assert all(100 <= t < 49152 for p in wl.prompts for t in p)
    assert make_workload("M3", 49152, seed=1).prompts != make_workload("M3", 49152, seed=0).prompts
