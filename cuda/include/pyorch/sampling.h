// Sampling-side ops on the logits: the structured-output token bitmask and the random draw.
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

// One token per row drawn from softmax(logits[r] / temperature[r]), by the exponential race:
// out[r] = the first index j of the largest
//     s_j = logits[r, j] / temperature[r] - log(-log(u_rj))          (float32 arithmetic)
// where u_rj = philox::uniform_open(word j % 4 of philox::token_words(seeds[r], j / 4))
// (pyorch/philox.h): -log(u) ~ Exp(1), and argmax_j p_j / q_j over independent q_j ~ Exp(1) is an
// exact draw from p. A row's tokens depend only on its logits, temperature and seed. A row with
// temperature[r] <= 0 is greedy: out[r] = the first index of its largest logit. NaN compares as
// the largest value (torch.argmax's rule); -inf logits are never drawn unless the whole row is
// -inf (then out[r] = 0).
//   logits:      [num_rows, vocab_size] (row stride logits_stride, last dim contiguous)
//   temperature: [num_rows] float32;  seeds: [num_rows] int64 (bit pattern as the Philox key)
//   out:         [num_rows] int64
// dtype: fp32, fp16 or bf16; 1 <= vocab_size < 2^31.
cudaError_t random_sample_from_logits(int64_t* out, const void* logits, const float* temperature,
                                      const int64_t* seeds, DType dtype, int64_t num_rows,
                                      int64_t vocab_size, int64_t logits_stride,
                                      cudaStream_t stream);

}  // namespace pyorch
