"""Buckets (`transform(..., bucket_bytes=...)`): consecutive units sharing one ring message per
step. Parity with DDP at 2, 3 and 4 ranks on models with uneven sizes (padded shards), fused
and plain units and tied weights; the messages a step sends, counted by the ring; what a
bucket holds, measured; two forwards before one backward; the pass's invariant."""

import pytest
from jobs import (
    accumulate_like_ddp,
    bucket_buffers,
    bucket_parity,
    no_grad_then_train,
    two_forwards_then_backward,
)
from zoo import build

import rtp_compile
from rtp_compile.passes import PIPELINE
from rtp_compile.passes.manager.pipeline import InvariantError, run_pipeline

ALL = 1 << 40  # one bucket for every run of units that may share one


def expected_messages(prog) -> int:
    """3 (N - 1) per bucket and per unit outside one, 2 (N - 1) for the small parameters."""
    n = prog.ctx.world_size
    bucketed = {m for members in prog.ctx.buckets.values() for m in members}
    units = [
        u
        for u in prog.plan.units
        if u.kind in ("rotate", "fused", "gather") and u.name not in bucketed
    ]
    small = any(u.kind == "small" for u in prog.plan.units)
    return 3 * (n - 1) * (len(prog.ctx.buckets) + len(units)) + 2 * (n - 1) * small


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_buckets_train_like_ddp_and_send_one_message_per_step(world_size, seed):
    cases = [("mlp", ALL), ("gpt", ALL), ("conv", ALL), ("gpt", 6000)]
    results = rtp_compile.launch(bucket_parity, world_size, args=(cases, seed), timeout=500)
    for rank, per_case in enumerate(results):
        for (name, budget), r in per_case.items():
            prog = rtp_compile.transform(build(name, seed), world_size, bucket_bytes=budget)
            assert r["buckets"] == prog.ctx.buckets and r["buckets"], (name, budget)
            for what, err in r["errors"].items():
                assert err <= 1e-9, f"rank {rank} {name} {budget}: {what} rel. error {err:.2e}"
            assert r["messages"] == expected_messages(prog), (rank, name, budget, r)
            unbucketed = rtp_compile.transform(build(name, seed), world_size, bucket_bytes=0)
            assert r["messages"] < expected_messages(unbucketed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [3, 4])
def test_a_bucket_holds_at_most_its_budget_measured(world_size, seed):
    for rank, r in enumerate(
        rtp_compile.launch(bucket_buffers, world_size, args=(seed,), timeout=120)
    ):
        assert r["units"] == (2, 2)  # the fused block and the last linear: one bucket
        # forward: the N - 1 messages that arrived (the rank's own shards are its parameters)
        assert r["forward_bytes"] == (world_size - 1) * r["message"], (rank, r)
        assert world_size * r["message"] <= r["budget"]
        # backward: the N - 1 fetched and the N gradient rows, nothing more
        assert r["backward"] == 2 * world_size - 1, (rank, r)
        assert r["leftover"] == 0 and r["pending"] == 0 and r["pooled"] == 0, (rank, r)


@pytest.mark.timeout(300)
def test_bucketed_accumulation_no_grad_and_two_forwards_match_ddp(seed):
    for r in rtp_compile.launch(accumulate_like_ddp, 3, args=(seed, "mean", ALL), timeout=120):
        assert r["grad"] <= 1e-9, r
    for r in rtp_compile.launch(no_grad_then_train, 2, args=(seed, ALL), timeout=120):
        assert r["unchanged"] and r["no_grad_fn"] and r["grad"] <= 1e-9, r
    for r in rtp_compile.launch(two_forwards_then_backward, 3, args=(seed,), timeout=120):
        assert r["buckets"] and r["grad"] <= 1e-9, r


def test_buckets_follow_the_budget_dtype_and_ties():
    model = build("gpt", 0)
    default = rtp_compile.transform(model, 3)  # on by default: within the largest unit gathered
    largest = max(
        3 * sum(default.plan.params[p].shard_bytes for p in u.params.values())
        for u in default.plan.units
        if u.kind in ("rotate", "fused")
    )
    assert default.ctx.buckets
    for members in default.ctx.buckets.values():
        assert (
            3
            * sum(
                default.plan.params[p].shard_bytes
                for m in members
                for p in {u.name: u for u in default.plan.units}[m].params.values()
            )
            <= largest
        )
    assert rtp_compile.transform(model, 3, bucket_bytes=0).ctx.buckets == {}
    assert rtp_compile.transform(model, 1, bucket_bytes=ALL).ctx.buckets == {}
    prog = rtp_compile.transform(model, 3, bucket_bytes=ALL)
    units = {u.name: u for u in prog.plan.units}
    tied = [u.name for u in prog.plan.units if "wte.weight" in u.params.values()]
    assert len(tied) == 2  # the embedding and the tied head: they stay out of buckets
    assert not set(tied) & {m for members in prog.ctx.buckets.values() for m in members}
    small = rtp_compile.transform(model, 3, bucket_bytes=6000)
    for members in small.ctx.buckets.values():
        assert (
            3
            * sum(
                small.plan.params[p].shard_bytes for m in members for p in units[m].params.values()
            )
            <= 6000
        )
    assert len(small.ctx.buckets) > len(prog.ctx.buckets)
    with pytest.raises(ValueError, match='bucket_bytes must be None, "auto" or an int >= 0'):
        rtp_compile.transform(model, 2, bucket_bytes=-1)


def test_bucket_invariant_catches_a_bucket_over_its_budget():
    ctx = rtp_compile.transform(build("gpt", 0), 3, bucket_bytes=6000).ctx.for_world_size(3)
    at = [p.__name__ for p in PIPELINE].index("bucket_units")
    gm = run_pipeline(PIPELINE[: at + 1], ctx.fresh_graph(), ctx)  # up to the bucket pass
    PIPELINE[at].check(gm, ctx)  # as compiled: holds
    name, members = next(iter(ctx.buckets.items()))
    order = [u.name for u in ctx.plan.units if u.kind in ("rotate", "fused")]
    ctx.buckets[name] = (*members, order[order.index(members[-1]) + 1])
    with pytest.raises(InvariantError, match=f"bucket {name} holds .* over bucket_bytes"):
        PIPELINE[at].check(gm, ctx)
