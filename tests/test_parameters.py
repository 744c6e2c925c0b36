"""`gm.parameters()` of a rank module is exactly that rank's shards, one per model parameter:
what an optimizer built on it steps (no placeholders, no copies, nothing left out). The
transformers models are checked the same way by `jobs.hf_parity`, on every rank they train."""

import pytest
import torch
from zoo import ZOO, build

import rtp_compile


def assert_exactly_the_shards(model: torch.nn.Module, prog, rank: int):
    gm = prog.module(rank)
    named = dict(gm.named_parameters(remove_duplicate=False))
    assert len(named) == len(list(gm.parameters())) == len(list(model.parameters()))
    assert set(named) == set(prog.plan.params)
    for name, p in named.items():
        assert not p.is_meta, name
        assert tuple(p.shape) == tuple(prog.plan.params[name].shard_shape), name


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", list(ZOO))
def test_rank_parameters_are_the_shards(name, world_size):
    model = build(name, 0)
    prog = rtp_compile.transform(model, world_size)
    for rank in range(world_size):
        assert_exactly_the_shards(model, prog, rank)


def _live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process, each storage once."""
    import gc

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "gpt2"])
def test_a_rank_module_does_not_keep_the_users_model(name):
    """`prog = transform(model, N); gm = prog.module(rank); del model, prog` frees the full
    model: a rank module keeps of its program only the layouts, the buffer names and a meta
    skeleton of the model (`program_state`), never the model's tensors or the captured graph.
    Measured: weak references to the model and to each of its parameters die, and the live
    tensor bytes of the process fall by the model's parameters."""
    import gc
    import weakref

    if name == "gpt":
        model, examples = build("gpt", 0), {}
    else:
        pytest.importorskip("transformers")
        from hf_zoo import build_hf, hf_batch

        model, examples = build_hf(name, 0), {"example_kwargs": hf_batch(name, 0, 0, 0)}
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    prog = rtp_compile.transform(model, 2, **examples)
    gm = prog.module(0)
    refs = [weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()]
    before = _live_tensor_bytes()
    del model, prog
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert before - _live_tensor_bytes() >= full
    assert rtp_compile.state.program_state.state_of(gm).layouts  # what the module still needs
