"""Speculative decoding inside the continuous batch.

    schedule:     Speculation.extend(plan)  drafts for decoding requests (drafter), a length per
                                            request (cost model x acceptance), extra KV slots
    executor:     one forward over 1 + k rows per speculating request; every row sampled as the
                  request would be sampled at that position (verify.virtual_rows)
    postprocess:  verify.accepted: the longest draft prefix equal to what was sampled there, then
                  the token sampled after it; the rejected rows' slots go back to the pool

Drafts are deterministic (a point-mass proposal), so accepting draft j iff the token sampled at
position j equals it is exact rejection sampling: the output distribution is the target model's,
and seeded or greedy requests give the same tokens with speculation on and off.
"""
