"""rtp_compile.checkpoint: exact resume after a real kill, resharding, interoperable DCP files,
and loads that refuse what does not fit without touching a parameter."""

import multiprocessing

import pytest
import torch
from checkpoint_jobs import (
    die_mid_save,
    load_into_world_size,
    resharded_steps_match_ddp,
    save_after_steps,
    train_with_checkpoints,
)
from decoders import build_decoder
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from zoo import MLP, build

import rtp_compile
from rtp_compile.state import dcp as checkpoint

STEPS, EVERY = 7, 2


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """3 ranks, gpt, STEPS AdamW steps without a stop, a checkpoint every EVERY steps."""
    seed = 1234
    path = tmp_path_factory.mktemp("straight") / "ck"
    return seed, rtp_compile.launch(
        train_with_checkpoints, 3, timeout=120, args=("gpt", str(path), STEPS, EVERY, seed)
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("die", [("backward", 5), ("save", 4)])
def test_a_killed_run_resumes_bitwise_from_its_last_checkpoint(die, straight_run, tmp_path):
    # next to the uninterrupted run, one whose rank 1 is SIGKILLed half-way through step 5's
    # backward (its last checkpoint is after step 4), or while saving after step 4 (the last
    # complete checkpoint is then step 2's: a dying save leaves the previous one intact)
    seed, straight = straight_run
    path = str(tmp_path / "run")
    with pytest.raises(rtp_compile.RankError) as err:
        rtp_compile.launch(
            train_with_checkpoints, 3, timeout=120, args=("gpt", path, STEPS, EVERY, seed, die)
        )
    assert err.value.rank == 1 and "exit code" in str(err.value), err.value
    assert multiprocessing.active_children() == []

    resumed = rtp_compile.launch(
        train_with_checkpoints, 3, timeout=120, args=("gpt", path, STEPS, EVERY, seed, None, True)
    )
    for rank in range(3):
        (want_losses, want_state), (losses, state) = straight[rank], resumed[rank]
        assert losses == want_losses  # every step's loss, bitwise (floats compare exactly)
        assert state.keys() == want_state.keys()
        for key in state:
            assert torch.equal(state[key], want_state[key]), (rank, key)


@pytest.mark.timeout(120)
def test_a_rank_dying_mid_save_makes_the_others_raise_at_once_saying_so(tmp_path):
    with pytest.raises(rtp_compile.RankError) as err:
        rtp_compile.launch(die_mid_save, 3, args=(str(tmp_path),), timeout=60)
    assert err.value.rank == 1 and "SIGKILL" in str(err.value), err.value
    assert multiprocessing.active_children() == []
    for rank in (0, 2):
        seconds, message = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert float(seconds) < 10, (rank, seconds)  # not the group's 60 s timeout
        assert f"checkpoint.save: rank {rank} of 3 failed" in message, message
        assert "another rank probably died" in message, message
    assert not (tmp_path / "ck").exists()  # no checkpoint that looks complete


@pytest.fixture(scope="module")
def saved_by_4(tmp_path_factory):
    """gpt (a tied embedding and head, widths 37 and 10: uneven at 3 and 4 ranks) after two
    AdamW steps at 4 ranks: the checkpoint's path, and the saving job's full state and moments."""
    seed = 4321
    path = str(tmp_path_factory.mktemp("by4") / "ck")
    results = rtp_compile.launch(save_after_steps, 4, args=("gpt", path, 2, seed), timeout=120)
    return seed, path, results[0]


def _assert_same(loaded: dict, saved: dict, where) -> None:
    assert loaded["state"].keys() == saved["state"].keys()
    for key, value in saved["state"].items():
        assert torch.equal(loaded["state"][key], value), (where, key)
    for name, values in saved["moments"].items():
        for got, want in zip(loaded["moments"][name], values):
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(want)), (where, name)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_checkpoint_saved_by_4_ranks_loads_exactly_into_fewer(world_size, saved_by_4):
    _, path, saved = saved_by_4
    results = rtp_compile.launch(load_into_world_size, world_size, args=("gpt", path), timeout=120)
    for rank, loaded in enumerate(results):
        _assert_same(loaded, saved, (world_size, rank))


@pytest.mark.timeout(300)
def test_buffers_and_conv_kernels_reshard_too(tmp_path, seed):
    # BatchNorm statistics (each rank's own differ: rank 0's are saved, as DDP would next
    # broadcast them) and conv kernels, saved by 3 ranks, loaded by 2
    path = str(tmp_path / "ck")
    saved = rtp_compile.launch(save_after_steps, 3, args=("conv", path, 2, seed), timeout=120)
    for rank, loaded in enumerate(
        rtp_compile.launch(load_into_world_size, 2, args=("conv", path), timeout=120)
    ):
        _assert_same(loaded, saved[0], rank)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_2x2_mesh_saves_once_per_ring_and_loads_into_3_ranks(tmp_path, seed):
    # replicas hold the same shards: only the first replica's ring (global ranks 0 and 1)
    # writes the model and optimizer; the others' files hold only their own `extra`
    path = tmp_path / "ck"
    saved = rtp_compile.launch(
        save_after_steps, 4, args=("gpt", str(path), 2, seed, (2, 2)), timeout=120
    )
    size = {r: (path / f"__{r}_0.distcp").stat().st_size for r in range(4)}
    assert max(size[2], size[3]) < 10_000 < min(size[0], size[1]), size
    for rank, loaded in enumerate(
        rtp_compile.launch(load_into_world_size, 3, args=("gpt", str(path)), timeout=120)
    ):
        _assert_same(loaded, saved[0], rank)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_whose_hooks_split_a_packed_qkv_saves_and_loads_its_own_keys(tmp_path, seed):
    # NeoX keeps one wqkv and its state_dict speaks wq / wk / wv (state-dict hooks): the
    # checkpoint holds the model's own keys, the unsharded model loads dcp_to_torch_save's file
    # strictly, and 2 ranks load what 3 saved
    path = str(tmp_path / "ck")
    saved = rtp_compile.launch(save_after_steps, 3, args=("neox", path, 1, seed), timeout=120)
    dcp_to_torch_save(path, tmp_path / "ck.pt")
    file_state = torch.load(tmp_path / "ck.pt", weights_only=False)["model"]
    reference = build_decoder("neox", seed + 1)
    reference.load_state_dict(file_state, strict=True)
    assert list(file_state) == list(reference.state_dict())
    assert any(k.endswith(".wq.weight") for k in file_state)
    for key, value in reference.state_dict().items():
        assert torch.equal(value, saved[0]["state"][key]), key
    for rank, loaded in enumerate(
        rtp_compile.launch(load_into_world_size, 2, args=("neox", path), timeout=120)
    ):
        _assert_same(loaded, saved[0], rank)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_resharded_steps_equal_ddp_continuing_from_the_torch_save_file(world_size, saved_by_4):
    # continued by `world_size` ranks with RTP, and by DDP on the unsharded model and optimizer
    # that dcp_to_torch_save's file gives
    seed, path, _ = saved_by_4
    results = rtp_compile.launch(
        resharded_steps_match_ddp, world_size, args=("gpt", path, 2, seed), timeout=120
    )
    for rank, r in enumerate(results):
        assert r["keys_match"]  # the file's model keys are model.state_dict()'s, in order
        assert r["extra_rank"] == rank  # ranks 0..world_size-1 saved theirs too
        assert r["loss"] <= 1e-9 and r["param"] <= 1e-9, (rank, r)


def _trained_single_rank(name="mlp"):
    prog = rtp_compile.transform(build(name, 0), 1)
    gm = prog.module(0)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    gm(torch.randn(4, 3, 7, dtype=torch.float64)).sum().backward()
    opt.step()
    return prog, gm, opt


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.timeout(120)
def test_a_load_that_does_not_fit_raises_and_changes_nothing(tmp_path):
    prog, gm, opt = _trained_single_rank()
    path = tmp_path / "ck"
    checkpoint.save(path, gm, opt, extra={"step": 1})
    assert (path / ".metadata").is_file() and not (tmp_path / "ck.partial").exists()
    before = {k: v.clone() for k, v in prog.full_state_dict(gm).items()}

    with pytest.raises(FileNotFoundError, match="no .metadata"):
        checkpoint.load(tmp_path / "nowhere", gm)
    # a model whose widths differ (MLP with input width 6, not 7): parameter and shapes named
    narrower = rtp_compile.transform(MLP(d_in=6).double(), 1).module(0)
    with pytest.raises(
        ValueError,
        match=r"fc1.weight is shape \(11, 7\) in the checkpoint, the "
        r"model has \(11, 6\)",
    ):
        checkpoint.load(path, narrower)
    # an optimizer over other parameters
    wrong_opt = torch.optim.AdamW([gm.get_parameter("fc1.weight")], lr=1e-2)
    with pytest.raises(ValueError, match="parameter groups differ"):
        checkpoint.load(path, gm, wrong_opt)
    # saved without an optimizer, loaded with one
    checkpoint.save(tmp_path / "model_only", gm)
    with pytest.raises(KeyError, match="saved without an optimizer"):
        checkpoint.load(tmp_path / "model_only", gm, opt)
    after = prog.full_state_dict(gm)
    assert all(torch.equal(before[k], after[k]) for k in before)

    # and a fitting load restores exactly what was saved, optimizer included
    step_before = opt.state_dict()["state"][0]["step"].item()
    with torch.no_grad():
        for p in gm.parameters():
            p.add_(1.0)
    assert checkpoint.load(path, gm, opt) == {"step": 1}
    after = prog.full_state_dict(gm)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert opt.state_dict()["state"][0]["step"].item() == step_before


@pytest.mark.timeout(60)
def test_a_module_not_made_by_a_program_is_refused(tmp_path):
    with pytest.raises(ValueError, match="made by prog.module"):
        checkpoint.save(tmp_path / "ck", torch.nn.Linear(2, 2))
