"""The time model's predicted step against the measured one: `rtp-compile bench --predict`."""

from rtp_compile.apps.bench_time import main

if __name__ == "__main__":
    main()
