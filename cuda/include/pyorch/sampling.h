// Sampling-side ops on the logits: the structured-output token bitmask.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// Structured output (xgrammar's and vLLM's semantics): logits[r, t] = -inf wherever bit t % 32
// of word bitmask[r, t / 32] is 0, for each row r in indices (all num_rows rows when indices is
// null). Set bits leave the logit untouched.
//   logits:  [num_rows, vocab_size]              (row stride logits_stride, last dim contiguous)
//   bitmask: [num_rows, ceil(vocab_size / 32)]   int32 (row stride bitmask_stride)
//   indices: [num_indices] int32 row ids, or null; ids outside [0, num_rows) are skipped
//            (the device cannot report them without a synchronization; the adapters' callers
//            pass ids they built themselves, and the CPU op checks them).
// dtype: fp32, fp16 or bf16.
cudaError_t apply_token_bitmask_inplace(void* logits, const int32_t* bitmask,
                                        const int32_t* indices, DType dtype, int64_t num_rows,
                                        int64_t num_indices, int64_t vocab_size,
                                        int64_t logits_stride, int64_t bitmask_stride,
                                        cudaStream_t stream);

}  // namespace pyorch
