"""The device wing: the array backend (numpy on a CPU, cupy on a GPU), the generic fused
kernel maker and the fused softmax loss, and the strict stand-in for cupy that tests run
GPU code paths on."""
