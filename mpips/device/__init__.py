"""The device wing: where a worker computes (backend: numpy on a CPU, cupy on a GPU), the
array helpers models call (arrays), gradients staged out to host buffers (staging), host
memory on pages of its own (pages), BLAS thread counts (threads), the generic fused kernel
maker and the fused softmax loss (kernels), and the strict stand-in for cupy that tests run
GPU code paths on (standin)."""
