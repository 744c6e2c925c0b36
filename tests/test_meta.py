"""Models built on the meta device: `prog.module(rank, device=...)` materialises only the rank's
shards, by the modules' own initialisers (one module at a time, seeded by module name) or from a
full checkpoint (torch.save file, memory-mapped, or safetensors), one parameter at a time.

Real gloo jobs at world sizes 2 and 3: the shards equal `layout.shard` of the unsharded twin
`materialize_full` makes (so every world size gives the same model), a forward/backward and three
AdamW steps match that twin and DDP, checkpoints load exactly, and the bytes allocated while a
rank materialises (every op's fresh storages, watched) never exceed its shards plus one module.
"""

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import rtp_compile
from rtp_compile.apps.models import GPTConfig, TinyGPT

TOL = 1e-9
KINDS = ["gpt", "llama"]


def meta_model(kind: str) -> nn.Module:
    """A float64 model built on the meta device: nothing is allocated."""
    with torch.device("meta"):
        if kind == "gpt":
            model = TinyGPT(GPTConfig(vocab_size=67, block_size=8, n_layer=2, n_head=2, n_embd=12))
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            model = LlamaForCausalLM(
                LlamaConfig(
                    hidden_size=16,
                    intermediate_size=22,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    vocab_size=53,
                )
            )
    return model.to(torch.float64)


def batches(kind: str, seed: int, rank: int, steps: int = 3):
    vocab = 67 if kind == "gpt" else 53
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10)
    return [torch.randint(0, vocab, (2, 7), generator=g) for _ in range(steps)]


def call(kind):
    return (lambda m, x: m(x)) if kind == "gpt" else (lambda m, x: m(input_ids=x))


def output(out):
    return out.logits if hasattr(out, "logits") else out


class AllocationTracker(TorchDispatchMode):
    """Every storage an op allocates (an output aliasing none of its inputs, not on meta): the
    peak of their bytes alive at once, and the largest one."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # forget freed storages first: a new one may reuse a freed one's address
        self.alive = {k: v for k, v in self.alive.items() if v[0]() is not None}
        results = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, results):
            if isinstance(t, torch.Tensor) and ret.alias_info is None and not t.is_meta:
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in self.alive:
                    self.alive[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
                    self.largest = max(self.largest, storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))
        return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_bounds(prog, model: nn.Module) -> dict:
    """Bytes of a rank's shards, of the model's buffers, of the largest module's own
    parameters, of the largest parameter, and of the whole model's parameters."""
    own = [sum(nbytes(p) for p in m.parameters(recurse=False)) for m in model.modules()]
    return {
        "shards": sum(lay.shard_bytes for lay in prog.plan.params.values()),
        "buffers": sum(nbytes(b) for b in model.buffers()),
        "module": max(own),
        "param": max(nbytes(p) for p in model.parameters()),
        "model": sum(nbytes(p) for p in model.parameters()),
    }


def shard_mismatches(prog, gm, full: dict, rank: int) -> list[str]:
    """Parameters of `gm` that are not exactly `layout.shard(full[name], rank)`."""
    return [
        name
        for name, lay in prog.plan.params.items()
        if not torch.equal(
            gm.get_parameter(name).detach(), lay.shard(full[name].to(lay.dtype), rank)
        )
    ]


def meta_job(rank: int, world_size: int, kind: str, seed: int, pt: str, st: str) -> dict:
    """Materialise a meta model's rank module by initialisers, then from two checkpoints;
    train it next to the unsharded twin and DDP."""
    from jobs import train_next_to_ddp

    model = meta_model(kind)
    prog = rtp_compile.transform(model, world_size)
    reference = rtp_compile.materialize_full(model, seed)
    full = reference.state_dict()
    with AllocationTracker() as init_memory:
        gm = prog.module(rank, device="cpu", seed=seed)
    result = {
        "meta_after": all(p.is_meta for p in model.parameters()),
        "bounds": memory_bounds(prog, reference),
        "init_peak": init_memory.peak,
        "init_largest": init_memory.largest,
        "init_mismatch": shard_mismatches(prog, gm, full, rank),
        "buffers": {n: torch.equal(b, reference.get_buffer(n)) for n, b in gm.named_buffers()},
        "full_state": prog.full_state_dict(gm),
    }
    result["errors"] = train_next_to_ddp(
        prog, gm, reference, batches(kind, seed, rank), seed, call(kind), output
    )
    checkpoint = rtp_compile.materialize_full(model, seed + 1).state_dict()
    stored32 = {k: v.float().double() for k, v in checkpoint.items()}  # the .safetensors is fp32
    for path, expected in (("pt", checkpoint), ("st", stored32)):
        with AllocationTracker() as memory:
            loaded = prog.module(rank, device="cpu", checkpoint=pt if path == "pt" else st)
        result[f"{path}_peak"] = memory.peak
        result[f"{path}_mismatch"] = shard_mismatches(prog, loaded, expected, rank)
        result[f"{path}_buffers"] = {
            n: torch.equal(b, reference.get_buffer(n)) for n, b in loaded.named_buffers()
        }
    prog.load_full_state_dict(gm, st)  # the trained module takes the checkpoint back
    result["load_mismatch"] = shard_mismatches(prog, gm, stored32, rank)
    return result


def write_checkpoints(kind: str, seed: int, tmp_path) -> tuple[str, str]:
    """The twin of seed+1 as a torch.save'd state_dict (every name, tied ones too) and as
    float32 safetensors holding a tied weight under one name only (as transformers saves)."""
    from safetensors.torch import save_file

    model = meta_model(kind)
    state = rtp_compile.materialize_full(model, seed + 1).state_dict()
    pt, st = str(tmp_path / "full.pt"), str(tmp_path / "full.safetensors")
    torch.save(state, pt)
    drop = {"wte.weight"} if kind == "gpt" else set()  # stored as lm_head.weight only
    save_file({k: v.float().contiguous() for k, v in state.items() if k not in drop}, st)
    return pt, st


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_meta_model_materialises_shards_only(kind, world_size, seed, tmp_path):
    pytest.importorskip("safetensors")
    if kind == "llama":
        pytest.importorskip("transformers")
    pt, st = write_checkpoints(kind, seed, tmp_path)
    results = rtp_compile.launch(meta_job, world_size, args=(kind, seed, pt, st), timeout=300)
    reference = rtp_compile.materialize_full(meta_model(kind), seed).state_dict()
    for rank, r in enumerate(results):
        assert r["meta_after"], "materialising changed the user's meta model"
        # initialisers: exactly the unsharded twin's values, cut
        assert not r["init_mismatch"], (
            f"rank {rank}: shards differ from the twin's: {r['init_mismatch']}"
        )
        assert all(r["buffers"].values()), f"rank {rank}: buffers {r['buffers']}"
        full = r["full_state"]
        assert list(full) == list(reference)
        for k, v in reference.items():  # every world size gives the same model
            assert torch.equal(full[k], v), f"rank {rank} N={world_size}: {k}"
        # training: output vs the twin, gradients and 3 AdamW steps vs DDP of the twin
        for what, err in r["errors"].items():
            assert err <= TOL, f"rank {rank} {kind}: {what} rel. error {err:.2e}"
        # checkpoints: this rank's part of each parameter, buffers recomputed or loaded
        for path in ("pt", "st"):
            assert not r[f"{path}_mismatch"], f"rank {rank} {path}: {r[f'{path}_mismatch']}"
            assert all(r[f"{path}_buffers"].values()), f"rank {rank} {path}: {r[f'{path}_buffers']}"
        assert not r["load_mismatch"], f"rank {rank}: {r['load_mismatch']}"
        # memory: the tracker sees the shards being made, and never more than them + one module
        b = r["bounds"]
        print(
            f"{kind} N={world_size} rank {rank}: init peak {r['init_peak']:,} B, largest "
            f"{r['init_largest']:,} B; pt peak {r['pt_peak']:,} B, st peak {r['st_peak']:,} B; "
            f"shards {b['shards']:,} + buffers {b['buffers']:,} + largest module "
            f"{b['module']:,} (model {b['model']:,})"
        )
        assert b["shards"] + b["module"] < b["model"], "model too small for the test to mean much"
        assert b["shards"] <= r["init_peak"] <= b["shards"] + b["buffers"] + b["module"], b
        assert r["init_largest"] <= b["module"]
        for path in ("pt", "st"):
            assert b["shards"] <= r[f"{path}_peak"] <= b["shards"] + b["buffers"] + b["param"], b


# -- semantics and errors, in one process (module(rank) needs no process group) ---------------


def test_init_is_the_modules_own_seeded_per_module():
    model = meta_model("gpt")
    a, b = (rtp_compile.materialize_full(model, s) for s in (0, 0))
    other = rtp_compile.materialize_full(model, 1)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    assert not torch.equal(a.wte.weight, other.wte.weight)
    assert a.lm_head.weight is a.wte.weight  # still tied
    assert all(p.is_meta for p in model.parameters())  # the meta model is untouched
    # TinyGPT._init_weights after reset_parameters: N(0, 0.02) weights, zero biases, unit norms
    qkv = a.blocks[0].attn.qkv
    assert abs(qkv.weight.std().item() - 0.02) < 0.005 and not qkv.bias.any()
    assert torch.equal(a.blocks[0].ln_1.weight, torch.ones(12, dtype=torch.float64))
    # the module name seeds the stream: two same-shaped layers differ
    assert not torch.equal(a.blocks[0].attn.proj.weight, a.blocks[1].attn.proj.weight)
    # a module's values do not depend on the others: seed of (0, name) alone
    from rtp_compile.state.materialize import init_module

    alone = init_module(model, "blocks.1.attn.proj", ["weight", "bias"], [], "cpu", 0)
    assert torch.equal(alone["weight"], a.blocks[1].attn.proj.weight)


def test_llama_init_follows_transformers_init_weights():
    pytest.importorskip("transformers")
    model = rtp_compile.materialize_full(meta_model("llama"), 3)
    config = model.config
    w = model.model.layers[0].mlp.gate_proj.weight
    assert abs(w.std().item() - config.initializer_range) < 0.005
    assert torch.equal(model.model.norm.weight, torch.ones(16, dtype=torch.float64))
    head_dim = 16 // 4  # rotary inv_freq recomputed by _init_weights, as in eager
    expected = 1.0 / (
        config.rope_parameters["rope_theta"]
        ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    )
    assert torch.equal(model.model.rotary_emb.inv_freq, expected.double())


def test_real_model_program_is_unchanged():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=67, block_size=8, n_layer=1, n_head=2, n_embd=12))
    prog = rtp_compile.transform(model, 2)
    for device in (None, "cpu"):
        gm = prog.module(1, device=device, seed=123)  # the seed only seeds meta tensors
        assert not shard_mismatches(prog, gm, model.state_dict(), 1)


def test_meta_program_without_device_stays_meta():
    prog = rtp_compile.transform(meta_model("gpt"), 2)
    gm = prog.module(0)
    assert all(p.is_meta for p in gm.parameters())
    assert tuple(gm.get_parameter("wte.weight").shape) == prog.plan.params["wte.weight"].shard_shape


def test_bad_checkpoint_names_the_parameter_and_writes_nothing(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    model = meta_model("gpt")
    prog = rtp_compile.transform(model, 2)
    gm = prog.module(1, device="cpu", seed=0)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    state = rtp_compile.materialize_full(model, 1).state_dict()
    wrong = dict(state, **{"blocks.1.mlp.0.weight": torch.zeros(48, 11, dtype=torch.float64)})
    torch.save(wrong, tmp_path / "wrong.pt")
    missing = {
        k: v.contiguous()
        for k, v in state.items()
        if k not in ("blocks.0.attn.proj.bias", "wte.weight", "lm_head.weight")
    }
    save_file(missing, tmp_path / "missing.safetensors")
    for path, error, names in (
        (tmp_path / "wrong.pt", ValueError, ["blocks.1.mlp.0.weight"]),
        (
            tmp_path / "missing.safetensors",
            KeyError,
            ["blocks.0.attn.proj.bias", "wte.weight/lm_head.weight"],
        ),
    ):
        for load in (
            lambda: prog.load_full_state_dict(gm, path),
            lambda: prog.module(1, device="cpu", checkpoint=path),
        ):
            with pytest.raises(error) as info:
                load()
            assert all(n in str(info.value) for n in names), str(info.value)
            assert "nothing was loaded" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())
    with pytest.raises(ValueError, match="needs a real device"):
        prog.module(0, checkpoint=tmp_path / "wrong.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prog.module(0, device="cpu", checkpoint=tmp_path / "nope.pt")
    torch.save({"model": state}, tmp_path / "nested.pt")
    with pytest.raises(ValueError, match="does not hold a state_dict"):
        prog.module(0, device="cpu", checkpoint=tmp_path / "nested.pt")


class Scaled(nn.Module):
    """A parameter made in __init__ with no reset_parameters: on meta it has no value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.fc(x) * self.scale


class WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.offset = torch.ones(6)  # a plain tensor attribute: a graph constant

    def forward(self, x):
        return self.fc(x) + self.offset


class FilledByReset(Scaled):
    def reset_parameters(self):
        nn.init.ones_(self.scale)


class FilledThroughData(Scaled):
    """Old-style initialisers: writes through `.data`, and `.data` replaced."""

    def reset_parameters(self):
        self.scale.data.fill_(2.0)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.bias.data = torch.full_like(module.bias, 3.0)


def test_meta_tensor_without_initialiser_is_a_clear_error():
    with torch.device("meta"):
        scaled, constant, filled = Scaled(), WithConstant(), FilledByReset()
    with pytest.raises(RuntimeError, match=r"parameter scale of Scaled .*reset_parameters\(\)"):
        rtp_compile.transform(scaled, 2).module(0, device="cpu")
    with pytest.raises(RuntimeError, match="parameter scale of Scaled"):
        rtp_compile.materialize_full(scaled)
    with pytest.raises(ValueError, match="offset is a meta tensor"):
        rtp_compile.transform(constant, 2).module(0, device="cpu")
    gm = rtp_compile.transform(filled, 2).module(0, device="cpu")  # what the message advises
    assert torch.equal(gm.get_parameter("scale"), torch.ones(3))
    with torch.device("meta"):
        through_data = FilledThroughData()
    twin = rtp_compile.materialize_full(through_data)
    assert torch.equal(twin.scale, torch.full((6,), 2.0))
    assert torch.equal(twin.fc.bias, torch.full((6,), 3.0))
