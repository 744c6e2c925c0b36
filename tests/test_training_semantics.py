"""What a DDP user expects of a training loop holds for the emitted modules."""

import pytest
from jobs import (
    accumulate_like_ddp,
    across_a_recreated_group,
    buffers_like_ddp,
    no_grad_then_train,
    state_dict_roundtrip,
    subgroup_programs,
)

import rtp_compile

TOL = 1e-9


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_no_grad_and_eval_leave_parameters_untouched(world_size, seed):
    for r in rtp_compile.launch(no_grad_then_train, world_size, args=(seed,), timeout=120):
        assert r["unchanged"] and r["no_grad_fn"]
        assert r["no_grad_out"] <= TOL and r["eval_out"] <= TOL
        assert r["grad"] <= TOL


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_accumulate_across_backward_calls_like_ddp(reduction, seed):
    for r in rtp_compile.launch(accumulate_like_ddp, 3, args=(seed, reduction), timeout=120):
        assert r["grad"] <= TOL


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_state_dict_roundtrip(seed, tmp_path):
    results = rtp_compile.launch(
        state_dict_roundtrip, 3, args=(seed, str(tmp_path / "sd")), timeout=120
    )
    for rank, per_model in enumerate(results):
        for name, r in per_model.items():
            assert r["same_keys"] and r["exact"] and r["loaded"] and r["copies_state"], (
                rank,
                name,
                r,
            )
            assert r["output"] <= TOL and r["copies"] <= TOL, (rank, name, r)


@pytest.mark.timeout(300)
def test_group_argument_confines_communication_to_the_group(seed):
    for r in rtp_compile.launch(subgroup_programs, 4, args=(seed,), timeout=120):
        assert r["output"] <= TOL and r["grad"] <= TOL


@pytest.mark.timeout(300)
@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_behave_as_under_ddp(broadcast, seed):
    """BatchNorm statistics: DDP's broadcast_buffers=True (default: every forward starts from
    rank 0's buffers) and False (each rank keeps its own) are both matched exactly."""
    for r in rtp_compile.launch(buffers_like_ddp, 3, args=(seed, broadcast), timeout=120):
        assert r["names"] == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
        assert r["buffers"] <= 1e-12 and r["eval_output"] <= 1e-9


@pytest.mark.timeout(300)
def test_a_job_that_recreates_its_process_group_keeps_training(seed):
    from rtp_compile.runtime.launch import free_port

    results = rtp_compile.launch(across_a_recreated_group, 2, args=(free_port(), seed), timeout=120)
    assert results == [{"same_grads": True, "timeout_s": 77.0, "world": True}] * 2
