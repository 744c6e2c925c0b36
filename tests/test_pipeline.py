"""The pass pipeline: one ordered list of `(gm, ctx) -> gm` passes, each one's invariant checked
after it, optional passes switched off by name without losing parity, a diff per pass."""

import logging

import pytest
import torch
import torch.fx as fx
from jobs import parity_without
from zoo import build

import rtp_compile
from rtp_compile.core.ir import label_of
from rtp_compile.passes import PIPELINE
from rtp_compile.passes.manager.pipeline import InvariantError

OPTIONAL = [
    "lower_modules",
    "fold_parameter_metadata",
    "split_norm_affine",
    "fuse_blocks",
    "gather_small_params",
    "bucket_units",
]


def test_pipeline_is_one_ordered_list_of_checked_passes():
    assert [p.__name__ for p in PIPELINE] == [
        "lower_modules",
        "fold_parameter_metadata",
        "split_norm_affine",
        "plan_sharding",
        "fuse_blocks",
        "gather_small_params",
        "rotate",
        "bucket_units",
        "cast_precision",
        "schedule",
    ]
    assert [p.__name__ for p in PIPELINE if not p.required] == OPTIONAL
    assert all(callable(p.check) for p in PIPELINE)


def test_debug_logs_and_keeps_each_pass_diff(caplog):
    with caplog.at_level(logging.INFO, logger="rtp_compile"):
        prog = rtp_compile.transform(build("gpt", 0), 2, debug=True)
    log = {r.name: r for r in prog.pass_log}
    assert list(log) == [p.__name__ for p in PIPELINE]
    assert [m.split(":")[0] for m in caplog.messages] == list(log)
    lowered = log["lower_modules"].changed_ops()
    assert lowered["call_module:wte"] == (1, 0) and lowered["call_function:linear"][0] == 0
    assert log["plan_sharding"].added == log["plan_sharding"].removed == []  # plan only
    hops = log["schedule"].changed_ops()["call_function:rtp.ring_shift_start.default"]
    units = [u for u in prog.plan.units if u.kind in ("rotate", "fused")]
    bucketed = sum(len(members) for members in prog.ctx.buckets.values())
    assert prog.ctx.buckets and bucketed <= len(units)
    # N - 1 = 1 forward hop per unit alone and per bucket
    assert hops == (0, len(units) - bucketed + len(prog.ctx.buckets))
    assert "ring_shift_start" in log["schedule"].diff() and "+" in log["rotate"].diff()
    quiet = rtp_compile.transform(build("gpt", 0), 2)
    assert quiet.pass_log[-1].code_before is None and "debug=True" in quiet.pass_log[-1].diff()


def test_disabled_passes_change_the_plan_as_they_should():
    def kinds(model, **kw):
        return {u.kind for u in rtp_compile.transform(model, 2, **kw).plan.units}

    assert "fused" in kinds(build("gpt", 0)) and "fused" not in kinds(
        build("gpt", 0), disable=["fuse_blocks"]
    )
    plain = rtp_compile.transform(build("conv", 0), 2, disable=["split_norm_affine"])
    assert any(u.kind == "gather" and "norm" in u.target for u in plain.plan.units)
    unlowered = rtp_compile.transform(build("mlp", 0), 2, disable=["lower_modules"])
    assert all(u.kind == "gather" for u in unlowered.plan.units)
    assert "is called as one module" in unlowered.report()
    assert rtp_compile.transform(build("mlp", 0), 2, disable=["lower_modules"]).pass_log[0].skipped


def test_required_or_unknown_passes_cannot_be_disabled():
    with pytest.raises(ValueError, match="cannot be disabled"):
        rtp_compile.transform(build("mlp", 0), 2, disable=["rotate"])
    with pytest.raises(ValueError, match="names no pass: \\['fuse'\\]"):
        rtp_compile.transform(build("mlp", 0), 2, disable=["fuse"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_optional_pass_disabled_in_turn_keeps_parity(seed):
    cases = [(name, "fx", p) for p in OPTIONAL for name in ("mlp", "gpt", "conv")] + [
        ("attention", "export", p)
        for p in ("split_norm_affine", "fuse_blocks", "gather_small_params")
    ]
    results = rtp_compile.launch(parity_without, 2, args=(cases, seed), timeout=400)
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(cases)
        for case, errors in per_case.items():
            for what, err in errors.items():
                assert err <= 1e-9, f"rank {rank} {case}: {what} rel. error {err:.2e}"


def _scheduled(world_size=3):
    prog = rtp_compile.transform(torch.nn.Linear(6, 10), world_size)
    gm = fx.GraphModule(prog.graph_module, prog.graph_module.graph)
    return prog, gm


def test_schedule_invariant_catches_a_parameter_read_outside_a_unit():
    prog, gm = _scheduled()
    schedule = PIPELINE[-1]
    schedule.check(gm, prog.ctx)  # as compiled: holds
    read = next(n for n in gm.graph.nodes if n.op == "get_attr")
    with gm.graph.inserting_after(read):
        gm.graph.call_function(torch.relu, (read,))
    with pytest.raises(InvariantError, match="read outside a unit"):
        schedule.check(gm, prog.ctx)


def test_schedule_invariant_catches_a_wait_before_the_compute_it_overlaps():
    prog, gm = _scheduled()
    nodes = list(gm.graph.nodes)
    wait = next(n for n in nodes if getattr(label_of(n), "action", None) == "wait")
    start = next(n for n in nodes if getattr(label_of(n), "action", None) == "start")
    start.append(wait)  # the wait now comes right after its start, before step 0 computes
    with pytest.raises(InvariantError, match="hop 1 is not started before step 0 computes"):
        PIPELINE[-1].check(gm, prog.ctx)


def test_plan_invariant_catches_a_parameter_without_a_layout():
    prog, gm = _scheduled()
    del prog.ctx.plan.params["bias"]
    with pytest.raises(InvariantError, match="exactly the model's parameters"):
        PIPELINE[3].check(gm, prog.ctx)


def test_planning_passes_are_marked_and_one_that_changes_the_graph_is_caught(monkeypatch):
    """plan_sharding, fuse_blocks, gather_small_params and bucket_units only write the plan;
    the runner refuses a planning pass that touched a node."""
    assert [p.__name__ for p in PIPELINE if p.plans_only] == [
        "plan_sharding",
        "fuse_blocks",
        "gather_small_params",
        "bucket_units",
    ]
    import rtp_compile.passes as passes
    from rtp_compile.passes.manager.pipeline import graph_pass

    @graph_pass(check=lambda gm, ctx: None, plans_only=True)
    def sneaky(gm, ctx):
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(x):
            gm.graph.call_function(torch.relu, (x,))
        return gm

    monkeypatch.setattr(passes, "PIPELINE", [*PIPELINE[:3], sneaky, *PIPELINE[3:]])
    with pytest.raises(InvariantError, match="sneaky is a planning pass but changed the graph"):
        rtp_compile.transform(build("mlp", 0), 2)
