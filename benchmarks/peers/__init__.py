"""``ferry serve`` beside its peers (vLLM's CPU build) on the same trace, one board, and the
trace's GEMM limit on this machine that the board measures every server against."""
