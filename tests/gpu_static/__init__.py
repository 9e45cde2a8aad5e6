"""Static GPU checks that need no GPU: AOT Triton compilation, fake CUDA tensors, fake NCCL groups,
flash-attn's real Python interface over a stand-in extension. Shared machinery of tests/test_gpu_static_*.py."""
