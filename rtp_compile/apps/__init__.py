"""The applications built on the library: the command line (`cli`), the demo (`demo`,
with its text `corpus` and model `models`), the benchmarks (`bench_speed`, `bench_memory`) and
model presets (`presets`); `data/` holds the demo's text.

May import: anything of rtp_compile below the root (never the root package itself)."""
