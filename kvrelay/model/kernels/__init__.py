"""The kernel seam: one backend interface, the pure-torch and native CPU backends behind it,
attention, RoPE, GEMM choice, decode graphs and huge pages. Nothing above it imports the native
module directly."""
