// Used only by the adapter syntax check on CPU-only machines: a CPU build of torch ships c10/cuda
// headers but not this generated one. Real CUDA builds use torch's own copy.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
