"""Graph -> graph passes of rtp_compile, each one job (imported as rtp_compile.passes)."""
