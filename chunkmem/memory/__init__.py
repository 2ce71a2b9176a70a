"""What lies under the Device interface: CUDA and its CPU simulation, host memory, native kernels, GPU readings."""
