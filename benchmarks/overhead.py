"""The runtime's cost without communication (fake process group), eager and compiled, N = 2, 4, 8:
`rtp-compile bench --overhead` (same code)."""

from rtp_compile.apps.bench_overhead import main

if __name__ == "__main__":
    main()
