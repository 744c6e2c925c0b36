"""Mixed precision with FSDP2's own policy class (issue 12): `transform(..., mp_policy=
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32))` trains like FSDP2 with the
same policy. The shards the optimizer steps stay float32, their gradients land in float32,
the weights rotate in bfloat16 and the gradient accumulators in float32 (seen on the messages
the runtime sends), and the losses of a few AdamW steps differ from FSDP2's by no more than
bfloat16 rounding explains: measured against FSDP2-bf16's own distance from float32 training."""

import pickle

import pytest
import torch
import torch.distributed as dist
from hf_zoo import logits_of
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import rtp_compile
from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_loss

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# sizes 2 and 3 ranks do not divide (vocabulary 53, width 25, hidden 100 at N = 3)
CONFIG = GPTConfig(vocab_size=53, block_size=8, n_layer=2, n_head=5, n_embd=25)
BATCH, STEPS, LR = 4, 4, 1e-2
# every runtime path once: small parameters gathered per step and unbucketed units (the
# default); one bucket of everything with rotated norms; gathered norms (no affine split)
RTP_OPTIONS = {
    "default": {},
    "bucketed": {"bucket_bytes": 1 << 30, "small_param_bytes": 0},
    "gathered": {"disable": ["split_norm_affine", "fuse_blocks"]},
}


def _batches(seed: int, rank: int):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return [
        torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
        for _ in range(STEPS)
    ]


def _train(module, params, batches) -> tuple[list[float], torch.dtype]:
    """AdamW steps on this rank's batches: the losses, and the output's dtype."""
    opt = torch.optim.AdamW(params, lr=LR)
    losses = []
    for idx in batches:
        out = module(idx[:, :-1])
        loss = lm_loss(out.float(), idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, out.dtype


def _fsdp2(model, world_size: int, policy):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    kwargs = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _watch_ring(sent: list):
    """Record the dtypes and bytes of every message this rank's runtime sends (the real
    send still happens): the runtime's own `ring.shift_start`, wrapped."""
    from rtp_compile.runtime import ring

    send = ring.shift_start

    def watched(tensors, group_name, shift, tag, where, pooled=True):
        sent.append(
            (where, {t.dtype for t in tensors}, sum(t.numel() * t.element_size() for t in tensors))
        )
        return send(tensors, group_name, shift, tag, where, pooled)

    ring.shift_start = watched
    return send


def _first_step(prog, rank: int, batch) -> dict:
    """One forward and backward of a fresh rank module: the dtypes of its shards and their
    gradients, and what the ring sent (bytes, and each message as `_watch_ring` saw it)."""
    from rtp_compile.runtime import ring

    gm = prog.module(rank)
    sent = []
    send = _watch_ring(sent)
    try:
        before = ring.traffic["bytes"]
        gm(batch[:, :-1]).float().sum().backward()
        traffic = ring.traffic["bytes"] - before
    finally:
        ring.shift_start = send
    return {
        "params": {p.dtype for p in gm.parameters()},
        "grads": {p.grad.dtype for p in gm.parameters()},
        "shards": all(
            tuple(gm.get_parameter(n).shape) == lay.shard_shape
            for n, lay in prog.plan.params.items()
        ),
        "traffic": traffic,
        "sent": sent,
        "kinds": {u.kind for u in prog.plan.units},
    }


def mixed_precision_job(rank: int, world_size: int, seed: int) -> dict:
    """FSDP2 with and without the policy, and RTP with it on each runtime path: the losses of
    AdamW steps, the outputs' dtype, and the first step of RTP with and without it."""
    torch.set_default_dtype(torch.float32)  # as the test process, whatever the fork server had
    batches = _batches(seed, rank)
    out = {}
    for name, policy in (("fsdp2-fp32", None), ("fsdp2-bf16", BF16)):
        torch.manual_seed(seed)  # the same initial weights
        fsdp = _fsdp2(TinyGPT(CONFIG), world_size, policy)
        out[name] = _train(fsdp, fsdp.parameters(), batches)
    torch.manual_seed(seed)
    model = TinyGPT(CONFIG)
    for kind, options in RTP_OPTIONS.items():
        prog = rtp_compile.transform(model, world_size, mp_policy=BF16, **options)
        fp32 = rtp_compile.transform(model, world_size, **options)
        out[kind] = {
            "bf16": _first_step(prog, rank, batches[0]),
            "fp32": _first_step(fp32, rank, batches[0]),
        }
        gm = prog.module(rank)
        out[kind]["losses"], out[kind]["dtype"] = _train(gm, gm.parameters(), batches)
    dist.barrier()
    return out


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _ring_checks(bf16: dict, fp32: dict) -> None:
    """Master shards and their gradients float32; every weight message sent in bfloat16, at
    half the bytes of float32's, every gradient accumulator in float32, at the same bytes."""
    assert bf16["shards"] and bf16["params"] == bf16["grads"] == {torch.float32}
    assert bf16["traffic"] == sum(b for *_, b in bf16["sent"])
    assert [w for w, *_ in bf16["sent"]] == [w for w, *_ in fp32["sent"]]
    kinds = set()
    for (where, dtypes, sent), (_, _, sent32) in zip(bf16["sent"], fp32["sent"]):
        kind = "gradient" if "gradient hop" in where else "weight"
        kinds.add(kind)
        expected = (
            ({torch.float32}, sent32) if kind == "gradient" else ({torch.bfloat16}, sent32 // 2)
        )
        assert (dtypes, sent) == expected, (where, dtypes, sent, sent32)
    assert kinds == {"gradient", "weight"}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_training_in_bfloat16_matches_fsdp2_with_the_same_policy(world_size, seed):
    """On each runtime path, the first step's messages as the runtime sends them
    (`_ring_checks`); then per rank the losses of 4 AdamW steps (largest relative gap over the
    steps): RTP-bf16 against FSDP2-bf16 held to 4x FSDP2-bf16's own gap to float32 (FSDP2
    without a policy), with a floor of 2^-8 for a seed where that gap happens to be small.
    Measured on three seeds, per rank: FSDP2-bf16 vs float32 1.2e-4 to 7.3e-4; RTP-bf16 vs
    FSDP2-bf16 3e-5 to 4.8e-4 at N = 2, 1.0e-4 to 1.25e-3 at N = 3 (up to 3.5x the former on
    a rank: a row split sums N bfloat16 partial products where FSDP2's matmul rounds once).
    A floor of 2^-10 failed 1 seed in 25 at N = 3: over 50 seeds RTP-bf16's gap reached
    1.34e-3 while FSDP2-bf16's own was as low as 9.5e-5."""
    results = rtp_compile.launch(mixed_precision_job, world_size, args=(seed,), timeout=240)
    for rank, r in enumerate(results):
        fp32, bf16 = r["fsdp2-fp32"][0], r["fsdp2-bf16"][0]
        reference = _gap(bf16, fp32)
        print(
            f"N={world_size} rank {rank}: FSDP2-bf16 vs fp32 {reference:.2e}; RTP-bf16 vs "
            f"FSDP2-bf16 "
            + ", ".join(f"{k} {_gap(r[k]['losses'], bf16):.2e}" for k in RTP_OPTIONS)
            + "; ring bytes bf16/fp32 "
            + ", ".join(
                f"{k} {r[k]['bf16']['traffic']}/{r[k]['fp32']['traffic']}" for k in RTP_OPTIONS
            )
        )
        for kind in RTP_OPTIONS:
            _ring_checks(r[kind]["bf16"], r[kind]["fp32"])
            assert r[kind]["dtype"] == r["fsdp2-bf16"][1] == torch.bfloat16  # compute dtype
            assert _gap(r[kind]["losses"], bf16) <= max(4 * reference, 2**-8), (
                kind,
                r[kind]["losses"],
                bf16,
                fp32,
            )
        assert "small" in r["default"]["bf16"]["kinds"]
        assert "fused" in r["bucketed"]["bf16"]["kinds"]
        assert "gather" in r["gathered"]["bf16"]["kinds"]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 10), nn.Linear(10, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_the_policy_travels_with_the_program_and_shows_in_report_code_and_cost():
    """Pickled (as `launch` sends it), the program compiles again with its policy; the rank
    code casts each own shard once, before its first hop; the predicted ring traffic halves
    the weights' messages and keeps the gradients' (float32 reduction)."""
    model, x = MLP(), {"x": torch.randn(4, 6)}
    prog = pickle.loads(pickle.dumps(rtp_compile.transform(model, 2, mp_policy=BF16)))
    assert prog.ctx.options.mp_policy == BF16
    assert (
        "compute and rotation in torch.bfloat16, gradients reduced in torch.float32"
        in prog.report()
    )
    code = prog.module(0).code
    assert code.count(".to(torch.bfloat16)") == len(prog.plan.params), code
    fp32 = rtp_compile.transform(model, 2)
    bf16_bytes = prog.cost(4, example_kwargs=x).traffic_bytes
    # per unit and hop: forward weights, backward weights (halved), gradients (kept)
    assert 3 * bf16_bytes == 2 * fp32.cost(4, example_kwargs=x).traffic_bytes


def test_inputs_and_outputs_are_cast_as_fsdp2_casts_them():
    """Floating inputs are cast to param_dtype (`cast_forward_inputs`), outputs to
    `output_dtype` when set (else left in the compute dtype); gradients reach the input in its
    own dtype. One rank: no process group needed."""
    model, x = MLP(), torch.randn(4, 6, requires_grad=True)
    for output_dtype, expected in ((None, torch.bfloat16), (torch.float32, torch.float32)):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=output_dtype)
        gm = rtp_compile.transform(model, 1, mp_policy=policy).module(0)
        y = gm(x)
        assert y.dtype == expected
        y.float().sum().backward()
        assert x.grad.dtype == torch.float32
        assert {p.grad.dtype for p in gm.parameters()} == {torch.float32}
        torch.testing.assert_close(y.float(), model(x), atol=0.05, rtol=0.05)
        x.grad = None


def test_an_op_that_cannot_compute_in_param_dtype_is_named():
    """A linear whose input stays float32 (`cast_forward_inputs=False`), and a gathered op
    with no bfloat16 kernel: each a clear error naming the unit and its parameters."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    gm = rtp_compile.transform(MLP(), 1, mp_policy=policy).module(0)
    with pytest.raises(
        TypeError,
        match=r"unit fc2 \(fused block of fc1.weight, fc1.bias, "
        r"fc2.weight, fc2.bias\) computes in torch.bfloat16 .* but its input is "
        r"torch.float32",
    ):
        gm(torch.randn(4, 6))
    gm = rtp_compile.transform(MLP(), 1, mp_policy=policy, fuse=False).module(0)
    with pytest.raises(TypeError, match=r"unit fc1 \(linear of fc1.weight, fc1.bias\)"):
        gm(torch.randn(4, 6))

    class Inverse(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.eye(3) * 2)

        def forward(self, x):
            return x @ torch.linalg.inv(self.w)

    gm = rtp_compile.transform(Inverse(), 1, mp_policy=BF16).module(0)
    with pytest.raises(
        RuntimeError,
        match=r"gathered op .* \(parameters w\) failed with its "
        r"parameters in torch.bfloat16",
    ):
        gm(torch.randn(2, 3))


def test_a_policy_that_is_not_fsdp2s_is_refused():
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        rtp_compile.transform(MLP(), 1, mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="param_dtype must be None or a floating-point"):
        rtp_compile.transform(MLP(), 1, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["gpt2", "llama", "bert", "opt", "neox", "qwen2", "t5", "torch_encoder"]
)
def test_an_exported_model_is_captured_computing_in_param_dtype(name):
    """torch.export bakes the dtypes a model's code derives from its parameters into the graph
    (a norm's cast back to its input's dtype, a mask's `finfo(dtype).min`) and asserts the
    ones it saw; so the model is captured as FSDP2 runs it, its parameters in `param_dtype`,
    and export's dtype assertions are dropped. The user's parameters are untouched, and one
    rank computes what the model cast to bfloat16 computes (FSDP2 at N = 1), to bfloat16
    rounding. One rank: no process group needed."""
    pytest.importorskip("transformers")
    from hf_zoo import build_hf, hf_batch

    model = build_hf(name, 0).float()
    batch = {
        k: v.float() if v.is_floating_point() else v for k, v in hf_batch(name, 0, 0, 0).items()
    }
    storages = [p.data_ptr() for p in model.parameters()]
    prog = rtp_compile.transform(model, 1, example_kwargs=batch, mp_policy=BF16)
    assert [p.data_ptr() for p in model.parameters()] == storages
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not [
        n
        for n in prog.graph_module.graph.nodes
        if n.target is torch.ops.aten._assert_tensor_metadata.default
    ]
    out = logits_of(prog.module(0)(**batch))
    assert out.dtype == torch.bfloat16
    reference = logits_of(
        model.to(torch.bfloat16)(
            **{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
        )
    )
    torch.testing.assert_close(out.float(), reference.float(), atol=0.05, rtol=0.05)
