"""DDP / FSDP2 / DTensor TP / RTP step time side by side: `rtp-compile bench` (same code)."""

from rtp_compile.apps.bench_speed import main

if __name__ == "__main__":
    main()
