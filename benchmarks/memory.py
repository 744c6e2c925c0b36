"""Per-rank memory of one AdamW step, DDP / FSDP2 / RTP, measured: `rtp_compile.apps.bench_memory`.

python benchmarks/memory.py [--out benchmarks/out]      (same as: rtp-compile bench --memory)
"""

from rtp_compile.apps.bench_memory import main

if __name__ == "__main__":
    main()
