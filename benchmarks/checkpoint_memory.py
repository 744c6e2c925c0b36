"""What a checkpoint save adds to a rank's peak memory: RTP (`rtp_compile.checkpoint.save`) next
to FSDP2 (`dcp.save` of `get_state_dict`), the same model after one AdamW step, in one run.

Each rank resets its peak resident set (Linux: writing 5 to /proc/self/clear_refs), saves, and
reads the peak back: the bytes a save adds over what the process held before it (DCP's write
buffers, serialisation, any gathered copy), measured, not planned. Printed per N with what the
rank holds (its shards: parameters and AdamW moments) and the full model state for scale; a bar
plot is saved to --out.

    python benchmarks/checkpoint_memory.py [--world-sizes 2 4] [--vocab 1024] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import tempfile
import time

import torch

from rtp_compile.apps.bench_memory import CONFIG, _wrap
from rtp_compile.apps.models import lm_loss
from rtp_compile.core.tables import format_table
from rtp_compile.runtime.launch import launch

KINDS = ("fsdp2", "rtp")


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now, VmHWM: peak resident)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _save_peak(rank: int, world_size: int, kind: str, path: str, vocab: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rtp_compile.state import dcp as checkpoint

    config = dataclasses.replace(CONFIG, vocab_size=vocab)
    model = _wrap(kind, rank, world_size, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, vocab, (2, CONFIG.block_size + 1))
    lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
    opt.step()
    held = (
        sum(
            t.numel() * t.element_size()
            for p in model.parameters()
            for t in [p.to_local() if hasattr(p, "to_local") else p]
        )
        * 3
    )  # p + 2 moments
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    before, start = _status("VmRSS"), time.perf_counter()
    if kind == "rtp":
        checkpoint.save(path, model, opt)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
    seconds = time.perf_counter() - start
    return {"added": _status("VmHWM") - before, "held": held, "seconds": seconds}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--vocab",
        type=int,
        default=CONFIG.vocab_size,
        help="embedding rows; one N does not divide pads the shards, whose "
        "boxes are then written from copies",
    )
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.world_sizes:
            got = {
                kind: launch(_save_peak, n, args=(kind, f"{tmp}/{kind}{n}", args.vocab))
                for kind in KINDS
            }
            added = {kind: max(r["added"] for r in got[kind]) for kind in KINDS}
            held = max(r["held"] for r in got["rtp"])
            results.append(
                {"world_size": n, **{f"{k}_added": v for k, v in added.items()}, "rtp_held": held}
            )
            rows.append(
                (
                    n,
                    f"{held / 2**20:.1f}",
                    f"{added['fsdp2'] / 2**20:.1f}",
                    f"{added['rtp'] / 2**20:.1f}",
                    f"{added['rtp'] / max(added['fsdp2'], 1):.2f}",
                    f"{max(r['seconds'] for r in got['fsdp2']):.2f}",
                    f"{max(r['seconds'] for r in got['rtp']):.2f}",
                )
            )
    print(
        format_table(
            [
                (
                    "N",
                    "RTP rank holds MiB (params+moments)",
                    "FSDP2 save adds MiB",
                    "RTP save adds MiB",
                    "RTP/FSDP2",
                    "FSDP2 save s",
                    "RTP save s",
                )
            ]
            + rows
        )
    )
    _plot(results, pathlib.Path(args.out))
    return results


def _plot(results: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3))
    width = 0.35
    for i, kind in enumerate(KINDS):
        ax.bar(
            [j + i * width for j in range(len(results))],
            [r[f"{kind}_added"] / 2**20 for r in results],
            width,
            label=kind,
        )
    ax.set_xticks(
        [j + width / 2 for j in range(len(results))], [f"N={r['world_size']}" for r in results]
    )
    ax.set_ylabel("peak RSS a save adds (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "checkpoint_memory.png")
    print(f"plot: {out / 'checkpoint_memory.png'}")


if __name__ == "__main__":
    main()
