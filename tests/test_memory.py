"""No rank ever holds a full copy of a rotated weight; transient shard buffers stay at the bound.

Measured by watching every tensor the ops of a real 3- and 4-rank job create (storage sizes and
lifetimes), not by reading the plan. A unit's shards travel as one flat message; forward holds
at most 2 of a unit's messages (the one in hand and the incoming one), backward at most 4
(weights held + incoming, gradient accumulators outgoing + incoming), and no op ever creates a
tensor of a weight's full size. The model has a fused block and a plain rotated layer. After the step nothing shard-sized
is left but the gradients, and no communication is pending.
"""
import pytest

import rtp_compile
from jobs import buffer_peaks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [3, 4])
def test_transient_shard_buffers_are_bounded(world_size, seed):
    results = rtp_compile.launch(buffer_peaks, world_size, args=(seed,), timeout=120)
    for rank, r in enumerate(results):
        assert not r["full_size"], f"rank {rank}: {r['full_size'][:3]}"
        assert r["kinds"] == ["fused", "rotate"]
        for name, peak in r["forward"].items():  # exactly 2: the tracker does see the buffers
            assert peak == 2, f"rank {rank} forward {name}: {peak} shard buffers alive"
        for name, peak in r["backward"].items():
            assert 3 <= peak <= 4, f"rank {rank} backward {name}: {peak} shard buffers alive"
        assert r["leftover"] == {name: 0 for name in r["leftover"]}, f"rank {rank}: {r}"
        assert r["pending"] == 0
