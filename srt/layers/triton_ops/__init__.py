"""Triton kernels of the layer ops (RMSNorm, rotary embedding, SiLU-and-mul), launched by the
`srt::` custom ops their layers define. Each writes into outputs its caller allocated and
rounds to the activation dtype where the PyTorch reference rounds, so that the two differ at
most in a last bit (a sum taken in another order, a hardware exp or rsqrt)."""
