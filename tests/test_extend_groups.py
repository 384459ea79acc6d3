"""Grouping of extending requests in the torch attention backend."""
from hypothesis import given, strategies as st

from stemma.attention.torch_backend import extend_groups

reqs = st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 2000)), max_size=24)


@given(reqs, st.sampled_from([0, 64, 1 << 16]))
def test_every_extending_request_lands_in_one_group_with_bounded_padding(items, slack):
    prefix = [p for p, _ in items]
    extend = [e for _, e in items]
    groups = extend_groups(prefix, extend, slack)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == [i for i, e in enumerate(extend) if e > 1]
    for g in groups:
        padded = len(g) * max(extend[i] for i in g) * max(prefix[i] + extend[i] for i in g)
        area = sum(extend[i] * (prefix[i] + extend[i]) for i in g)
        assert len(g) == 1 or padded <= 2 * area + slack


def test_similar_prefills_share_one_group_and_a_long_chunk_goes_alone():
    assert extend_groups([0] * 4, [30, 35, 40, 33]) == [[0, 3, 1, 2]]
    assert extend_groups([0, 0, 0, 0], [20, 1, 25, 1024]) == [[0, 2], [3]]
