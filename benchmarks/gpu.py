"""What RTP costs on one GPU, beside the ring: three measurements printed as tables.

1. Per-shard matmul efficiency: the N steps of a rotation unit (each multiplies by 1/N of the
   weight; col split concatenates, row split sums) against the one unsplit matmul, in bf16, with
   and without the copy of the next shard into the receive buffer, at hidden 1024-8192, N 2-8.
2. One rank's training step (forward, backward, AdamW) of a GPT-2-size model on the GPU under a
   fake process group of N ranks (communication costs nothing, so what is left is the compute
   split into steps, the Python of the unit runtimes and the memory), against the same model
   trained plainly: step time and torch.cuda.max_memory_allocated.
3. The NCCL path: rtp_compile.launch on one GPU (world size 1, nccl) trains 2 steps equal to
   the plain model.

Run on a machine with a GPU: `python benchmarks/gpu.py [--quick]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch
import torch.nn.functional as F


def cuda_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_efficiency(hiddens, ranks, tokens: int) -> list[tuple]:
    rows = []
    for h in hiddens:
        rows += _efficiency_at(h, ranks, tokens)
        torch.cuda.empty_cache()  # this width's tensors went with the call
    return rows


def _efficiency_at(h: int, ranks, tokens: int) -> list[tuple]:
    """Rows of matmul_efficiency for hidden width h."""
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    x4 = torch.randn(tokens, 4 * h, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(4 * h, h, device="cuda", dtype=torch.bfloat16)  # col split
    down = torch.randn(h, 4 * h, device="cuda", dtype=torch.bfloat16)  # row split
    whole_up = cuda_ms(lambda: F.linear(x, up))
    whole_down = cuda_ms(lambda: F.linear(x4, down))
    rows = []
    for n in ranks:
        up_shards = list(up.chunk(n, 0))
        down_shards = list(down.chunk(n, 1))
        x_parts = list(x4.chunk(n, -1))
        recv_up, recv_down = (
            torch.empty_like(up_shards[0]),
            torch.empty_like(down_shards[0].contiguous()),
        )

        def col(copy):
            parts = []
            for s, w in enumerate(up_shards):
                if copy and s < n - 1:
                    recv_up.copy_(up_shards[s + 1])
                parts.append(F.linear(x, w))
            return torch.cat(parts, -1)

        def row(copy):
            y = None
            for s, w in enumerate(down_shards):
                if copy and s < n - 1:
                    recv_down.copy_(down_shards[s + 1])
                part = F.linear(x_parts[s], w)
                y = part if y is None else y.add_(part)
            return y

        for name, whole, fn in (("col (up)", whole_up, col), ("row (down)", whole_down, row)):
            steps = cuda_ms(lambda: fn(False))
            with_copy = cuda_ms(lambda: fn(True))
            rows.append((h, n, name, whole, steps, with_copy, whole / steps, whole / with_copy))
    return rows


def gpt(layers: int, width: int, heads: int, vocab: int, block: int):
    from rtp_compile.apps.models import GPTConfig, TinyGPT

    return TinyGPT(
        GPTConfig(vocab_size=vocab, block_size=block, n_layer=layers, n_head=heads, n_embd=width)
    )


def train_step_ms(module, idx, steps: int = 6) -> tuple[float, float]:
    """Median ms of a training step and the peak bytes allocated across them."""
    from rtp_compile.apps.models import lm_loss

    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step():
        loss = lm_loss(module(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def rank_step(ranks, cfg, batch: int) -> list[tuple]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import rtp_compile

    torch.manual_seed(0)
    model = gpt(**cfg)
    idx = torch.randint(0, cfg["vocab"], (batch, cfg["block"] + 1), device="cuda")
    plain = gpt(**cfg).cuda()
    plain.load_state_dict(model.state_dict())
    plain_ms, plain_peak = train_step_ms(plain, idx)
    del plain
    torch.cuda.empty_cache()
    rows = [("plain", 1, plain_ms, 1.0, plain_peak / 2**20, 1.0, "-")]
    for n in ranks:
        t = time.perf_counter()
        prog = rtp_compile.transform(model, n)
        compile_s = time.perf_counter() - t
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        try:
            gm = prog.module(0, device="cuda")
            ms, peak = train_step_ms(gm, idx)
            rows.append(
                (
                    f"RTP rank 0 of {n}",
                    n,
                    ms,
                    ms / plain_ms,
                    peak / 2**20,
                    peak / plain_peak,
                    f"{compile_s:.1f}",
                )
            )
            del gm
        finally:
            dist.destroy_process_group()
            torch.cuda.empty_cache()
    return rows


def nccl_job(rank, world_size, cfg):
    import copy

    import rtp_compile
    from rtp_compile.apps.models import lm_loss

    torch.manual_seed(0)
    model = gpt(**cfg)
    prog = rtp_compile.transform(model, world_size)
    gm = prog.module(rank, device="cuda")
    plain = copy.deepcopy(model).cuda()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (gm, plain)]
    idx = torch.randint(0, cfg["vocab"], (4, cfg["block"] + 1), device="cuda")
    losses = []
    for _ in range(2):
        pair = []
        for m, opt in zip((gm, plain), opts):
            loss = lm_loss(m(idx[:, :-1]), idx[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    state = prog.full_state_dict(gm)
    err = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    return {"backend": torch.distributed.get_backend(), "losses": losses, "param_err": err}


def table(header, rows, fmt):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(f.format(v) for f, v in zip(fmt, r)) + " |")
    print(flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    hiddens = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
    try:
        rows = matmul_efficiency(hiddens, [2, 4, 8], tokens=8192)
        print("## 1. per-shard matmul efficiency, bf16, 8192 tokens (unsplit ms / steps ms)")
        table(
            [
                "hidden",
                "N",
                "split",
                "unsplit ms",
                "N steps ms",
                "steps + recv copy ms",
                "efficiency",
                "with copy",
            ],
            rows,
            ["{}", "{}", "{}", "{:.3f}", "{:.3f}", "{:.3f}", "{:.2f}", "{:.2f}"],
        )
    except Exception:
        traceback.print_exc()
    cfg = dict(layers=12, width=768, heads=12, vocab=50257, block=1024)
    try:
        rows = rank_step([2, 4, 8], cfg, batch=4)
        print(
            "## 2. one rank's training step, GPT-2 124M shape (12 x 768, vocab 50257), batch "
            "4 x 1024, fp32, AdamW; fake process group (no communication)"
        )
        table(
            ["kind", "N", "step ms", "step / plain", "peak MiB", "peak / plain", "transform s"],
            rows,
            ["{}", "{}", "{:.1f}", "{:.2f}", "{:.0f}", "{:.2f}", "{}"],
        )
    except Exception:
        traceback.print_exc()
    try:
        import rtp_compile

        small = dict(layers=2, width=128, heads=4, vocab=512, block=64)
        result = rtp_compile.launch(nccl_job, 1, args=(small,), timeout=120)[0]
        print("## 3. launch on one GPU:", result, flush=True)
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    main()
