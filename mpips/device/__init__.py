"""The device wing: the array backend (numpy on a CPU, cupy on a GPU), the fused update
kernels, and the strict stand-in for cupy that tests run GPU code paths on."""
